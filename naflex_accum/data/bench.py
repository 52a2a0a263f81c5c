"""Throughput of the training data pipeline: ``python -m naflex_accum.data.bench --train-data PATTERN``.

Invariant: measures the loader alone (samples/s, image tokens/s, token slots/s), whole epoch and steady state.
"""
import argparse
import time
from typing import Dict

import torch
from open_clip.tokenizer import SimpleTokenizer

from .loader import make_train_loader
from .schedule import DataConfig


def measure(loader, epoch: int = 0) -> Dict[str, float]:
    loader.set_epoch(epoch)
    start = time.perf_counter()
    first = None
    samples = slots = 0
    for batch in loader:
        valid = batch["image"]["patch_valid"]
        if first is None:
            first = time.perf_counter()
            first_samples, first_tokens = valid.shape[0], int(valid.sum())
        samples += valid.shape[0]
        slots += valid.numel()
    end = time.perf_counter()
    tokens = loader.stats["image_tokens"]
    steady = max(end - first, 1e-9)
    return {"seconds": end - start, "first_batch_s": first - start,
            "samples_per_s": samples / (end - start), "image_tokens_per_s": tokens / (end - start),
            "token_slots_per_s": slots / (end - start),
            "steady_samples_per_s": (samples - first_samples) / steady,
            "steady_image_tokens_per_s": (tokens - first_tokens) / steady,
            "corrupt": loader.stats["corrupt"], "batches": loader.stats["batches"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m naflex_accum.data.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--train-data", required=True)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--naflex-seq-lens", type=int, nargs="+", default=[64, 144, 256])
    parser.add_argument("--naflex-max-tokens-per-batch", type=int, default=4096)
    parser.add_argument("--num-samples", type=int, default=4000)
    parser.add_argument("--context-length", type=int, default=32)
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    tokenizer = SimpleTokenizer(context_length=args.context_length)
    for workers in args.workers:
        cfg = DataConfig(train_data=args.train_data, seq_lens=args.naflex_seq_lens,
                         max_tokens_per_batch=args.naflex_max_tokens_per_batch, num_samples=args.num_samples,
                         workers=workers)
        r = measure(make_train_loader(cfg, tokenizer))
        print(f"workers={workers}: {r['batches']} batches in {r['seconds']:.1f}s (first {r['first_batch_s']:.1f}s): "
              f"{r['samples_per_s']:.0f} samples/s, {r['image_tokens_per_s']:.0f} image tokens/s, "
              f"{r['token_slots_per_s']:.0f} token slots/s; steady {r['steady_samples_per_s']:.0f} samples/s, "
              f"{r['steady_image_tokens_per_s']:.0f} image tokens/s; corrupt {r['corrupt']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
