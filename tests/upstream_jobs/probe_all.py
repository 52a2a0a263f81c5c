"""``naflex_accum.upstream.probe`` on this upstream for each task kind; prints one JSON object.

Run with upstream's ``src`` first on PYTHONPATH. Also says whether the probe
left the CPU random stream and the thread count as it found them.
"""
import json
import time

import torch


def main():
    import open_clip_train.train as train

    from naflex_accum.upstream.probe import probe

    torch.set_num_threads(2)
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    kinds = {}
    for kind in ("clip", "siglip", "coca"):
        start = time.time()
        found = probe(train, train._train_step_eager, kind)
        kinds[kind] = {"contract": found.contract and found.contract.name, "problem": found.problem,
                       "parts": found.parts, "seconds": round(time.time() - start, 3)}
    print(json.dumps({"kinds": kinds, "rng_undisturbed": torch.equal(torch.rand(3), expected),
                      "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
