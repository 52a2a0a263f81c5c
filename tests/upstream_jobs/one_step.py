"""One optimizer step of upstream open_clip main's own trainer on an uneven NaFlex window.

Run in a subprocess with upstream's ``src`` first on PYTHONPATH:
    python one_step.py WORKDIR SHARDS MODEL_NAME TOKENS_FLAG
Prints one JSON object. The trainer runs from the same seed on the same
shards (sample shuffle fixed by OPENCLIP_WDS_SAMPLE_SHUFFLE_*=1) once per
accumulation mode with ``naflex_accum.install(mode=...)`` in effect, and once
with upstream's own step. A recorder around whichever step is installed
keeps, at the window's first call, a deep copy of the task and optimizer
(same init, same learning rate), every microbatch as the trainer prepared it,
and the weights right after the optimizer step. The reference is upstream's
own unaccumulated step (``accum_freq == 1``) on the window's examples
concatenated (NaFlex padding is masked exactly), with ``--batch-size``
doubled so its one-batch loss scale ``N / (2 B)`` equals the window's
``N / (k B)``. SGD without momentum, so the weight update is ``-lr * grad``
and no scale error hides behind Adam; fp32, as upstream's default ``amp``
would round the comparison at fp16.

Then, from the same init and window, each step under fp16 autocast with a
GradScaler whose scale makes the gradients overflow: the step must be
skipped and the scale backed off exactly as upstream's own step does.
"""
import copy
import json
import logging
import sys

import torch

torch.set_num_threads(1)

WORK, SHARDS, MODEL, TOKENS_FLAG = sys.argv[1:5]  # the token-budget flag was renamed between the pinned commits
REFERENCE_BATCH_SIZE = 16
ARGS = ["--use-naflex", "--model", MODEL, "--train-data", SHARDS, "--dataset-type", "webdataset",
        "--train-num-samples", "40", "--batch-size", str(REFERENCE_BATCH_SIZE), "--naflex-seq-lens", "16", "64",
        TOKENS_FLAG, "512", "--accum-freq", "2", "--naflex-loss-scale", "linear",
        "--epochs", "1", "--workers", "0", "--opt", "timm/momentum", "--momentum", "0", "--wd", "0",
        "--lr", "1.0", "--warmup", "0", "--lr-scheduler", "const", "--seed", "0", "--device", "cpu", "--precision", "fp32",
        "--logs", f"{WORK}/logs", "--save-frequency", "0"]


def run_trainer(name):
    """Upstream's main once; returns what the recorder saw."""
    import open_clip_train.main as upstream_main
    import open_clip_train.train as train

    step = train._train_step_eager
    seen = {"batches": []}

    def recorder(task, batch, accum_state, optimizer, scaler, autocast, args):
        if not seen["batches"]:
            seen["init"] = copy.deepcopy((task, optimizer))
            seen["args"] = copy.copy(args)
        seen["batches"].append(copy.deepcopy(batch))
        result = step(task, batch, accum_state, optimizer, scaler, autocast, args)
        if result is not None and "after" not in seen:
            seen["after"] = weights(task)
        return result

    train._train_step_eager = recorder
    try:
        assert upstream_main.main(ARGS + ["--name", name]) is None
    finally:
        train._train_step_eager = step
        for handler in list(logging.getLogger().handlers):  # one out.log per run
            logging.getLogger().removeHandler(handler)
    return seen


def weights(task):
    return {k: v.detach().clone() for k, v in task.trainable_module.state_dict().items()}


def concat_padded(batches):
    """One NaFlex batch of every example, padded to the longest sequence (padding is masked)."""
    seq_len = max(b["image"]["patches"].shape[1] for b in batches)

    def pad(t):
        extra = seq_len - t.shape[1]
        return torch.cat([t, t.new_zeros((t.shape[0], extra, *t.shape[2:]))], 1) if extra else t
    image = {k: torch.cat([pad(b["image"][k]) for b in batches]) for k in ("patches", "patch_coord", "patch_valid")}
    if "seq_len" in batches[0]["image"]:
        image["seq_len"] = seq_len
    return {"image": image, "text": torch.cat([b["text"] for b in batches])}


def relative(got, want, init):
    """||got - want|| / ||want - init|| over every weight: the error relative to the update."""
    num = sum(float((got[k].double() - want[k].double()).pow(2).sum()) for k in want)
    den = sum(float((want[k].double() - init[k].double()).pow(2).sum()) for k in want)
    return (num / den) ** 0.5


def same_window(a, b):
    return len(a) == len(b) and all(
        torch.equal(x["text"], y["text"]) and torch.equal(x["image"]["patches"], y["image"]["patches"])
        for x, y in zip(a, b))


def overflow(step, seen):
    """``step`` on the recorded window from the recorded init, fp16 autocast, a scale that overflows."""
    from open_clip_train.precision import get_autocast

    task, optimizer = copy.deepcopy(seen["init"])
    before = weights(task)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 100)
    accum_state = ([], {})
    for batch in seen["batches"]:
        result = step(task, batch, accum_state, optimizer, scaler, get_autocast("amp", "cpu"), seen["args"])
    grads = [p.grad for p in task.trainable_module.parameters() if p.grad is not None]
    return {"returned": result is not None, "scale_after": scaler.get_scale(),
            "weights_unchanged": all(torch.equal(before[k], v) for k, v in weights(task).items()),
            "nonfinite_grads": sum(not bool(torch.isfinite(g).all()) for g in grads)}


def fix_sample_order():
    """Upstream's sample shuffle is seeded from time and pid: a buffer of one keeps shard order.

    89fb801 reads OPENCLIP_WDS_SAMPLE_SHUFFLE_* (set by the test); 5964c41 has only the module constants.
    """
    import open_clip_train.data as data

    data._SAMPLE_SHUFFLE_SIZE = data._SAMPLE_SHUFFLE_INITIAL = 1


def main():
    import open_clip_train.train as train

    import naflex_accum

    fix_sample_order()
    from open_clip_train.precision import get_autocast

    from naflex_accum.accum.modes import ACCUM_MODES, get_step

    upstream_step = train._train_step_eager
    runs = {}
    for mode in ACCUM_MODES:
        with naflex_accum.patched(mode=mode):
            runs[mode] = run_trainer(mode)
    runs["upstream"] = run_trainer("upstream")
    assert train._train_step_eager is upstream_step

    first = runs[ACCUM_MODES[0]]
    task, optimizer = copy.deepcopy(first["init"])
    init = weights(task)
    ref_args = copy.copy(first["args"])
    ref_args.accum_freq, ref_args.batch_size = 1, 2 * REFERENCE_BATCH_SIZE
    window = first["batches"]
    upstream_step(task, concat_padded(window), None, optimizer, None, get_autocast("fp32", "cpu"), ref_args)
    reference = weights(task)

    print(json.dumps({
        "split": [b["text"].shape[0] for b in window],
        "seq_lens": [b["image"]["patches"].shape[1] for b in window],
        "same_data": all(same_window(window, seen["batches"]) for seen in runs.values()),
        "same_init": all(all(torch.equal(init[k], v) for k, v in weights(seen["init"][0]).items())
                         for seen in runs.values()),
        "update_norm": relative(reference, init, {k: torch.zeros_like(v) for k, v in init.items()}),
        "rel_err": {name: relative(seen["after"], reference, init) for name, seen in runs.items()},
        "overflow": {**{mode: overflow(get_step(mode), first) for mode in ACCUM_MODES},
                     "upstream": overflow(upstream_step, first)},
    }))


if __name__ == "__main__":
    main()
