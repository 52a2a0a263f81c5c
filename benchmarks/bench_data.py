"""The NaFlex webdataset pipeline's throughput against what the demo's training step consumes.

Both are measured in this run on the demo data and the demo preset's schedule
(sequence lengths 16/36/64, a 2,048-token budget, batch divisor 4):
  pipeline   samples/s and image tokens/s the loader delivers alone (workers 0 and 2)
  training   samples/s and image tokens/s the demo's training step consumes on batches already in memory
             (naflex-tiny, --accum-freq 2, --naflex-loss-scale linear, the trainer's default step)
and prints their ratio; the target is >= 3x with 2 workers, so data never starves training.

    python benchmarks/bench_data.py [--data-dir DIR] [--num-samples 4000]
"""
import argparse
import statistics
import time
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import torch

DEMO = dict(seq_lens=(16, 36, 64), max_tokens_per_batch=2048, batch_divisor=4)


def loader_for(data, workers, num_samples, accum_freq=2):
    from open_clip.tokenizer import SimpleTokenizer

    from naflex_accum.data import DataConfig, make_train_loader

    cfg = DataConfig(train_data=data, num_samples=num_samples, workers=workers, accum_freq=accum_freq, **DEMO)
    return make_train_loader(cfg, SimpleTokenizer(context_length=32))


def training_consumption(data, steps, repeats=3):
    """Median samples/s and image tokens/s of the demo training step on prefetched batches."""
    from naflex_accum.models import create_model
    from naflex_accum.tasks import create_task
    from naflex_accum.train.main import select_step

    loader = loader_for(data, workers=0, num_samples=steps * 2 * 512)
    loader.set_epoch(0)
    batches = [b for _, b in zip(range(2 * steps), loader)]
    torch.manual_seed(0)
    task = create_task(create_model("naflex-tiny"))
    task.train()
    optimizer = torch.optim.AdamW(task.parameters(), lr=1e-4)
    step = select_step(SimpleNamespace(accum_mode="cached-loss"))
    args = SimpleNamespace(accum_freq=2, batch_size=64, naflex_loss_scale="linear", grad_clip_norm=None)
    samples = sum(b["text"].shape[0] for b in batches)
    tokens = sum(int(b["image"]["patch_valid"].sum()) for b in batches)
    rates = []
    for _ in range(repeats + 1):  # the first pass warms up
        state, start = ([], {}), time.perf_counter()
        for b in batches:
            result = step(task, b, state, optimizer, None, nullcontext, args)
            if result is not None:
                state = result[3]
        rates.append(time.perf_counter() - start)
    seconds = statistics.median(rates[1:])
    return samples / seconds, tokens / seconds


def main():
    from naflex_accum.commands.demo import default_data_dir, ensure_demo_data
    from naflex_accum.data.bench import measure

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=default_data_dir(), help="demo data (made if missing)")
    parser.add_argument("--num-samples", type=int, default=4000, help="samples per pipeline measurement")
    parser.add_argument("--train-steps", type=int, default=20, help="optimizer steps of the training measurement")
    args = parser.parse_args()
    data = ensure_demo_data(args.data_dir, 10000, 1000)["train"]
    print(f"demo data {data}; torch {torch.__version__}, {torch.get_num_threads()} thread(s) for training")
    train_sps, train_tps = training_consumption(data, args.train_steps)
    print(f"training consumes {train_sps:.0f} samples/s, {train_tps:.0f} image tokens/s")
    print("| pipeline workers | samples/s | image tokens/s | vs training (samples) | vs training (tokens) |")
    print("|---|---|---|---|---|")
    torch.set_num_threads(1)  # as in tests and the loader's workers: decoding is single-threaded per process
    for workers in (0, 2):
        r = measure(loader_for(data, workers, args.num_samples))
        print(f"| {workers} | {r['samples_per_s']:.0f} | {r['image_tokens_per_s']:.0f} | "
              f"{r['samples_per_s'] / train_sps:.2f}x | {r['image_tokens_per_s'] / train_tps:.2f}x |")


if __name__ == "__main__":
    main()
