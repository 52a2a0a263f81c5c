"""Accumulation cost against a full-batch step, on the CPU, in one process.

For a window of N samples in k microbatches (k = 1, 2, 4, 8) it times, with
warm-up and interleaved repeats, the median optimizer step of:
  full        one full-batch step over the N samples (accum_freq 1): the baseline, 1.00x
  upstream    upstream-style replay: the whole-window loss recomputed per
              microbatch, each replay scaled by its own size, logit parameters
              live in every replay, no RNG replay (written here as the baseline
              of the replay cost)
  replay      naflex_accum.train_step_eager (replay with one window scale)
  cached-loss naflex_accum.cached_loss_step (window loss once, GradCache)
and, with --memory, each variant's steady-state peak memory during a step
(the rise of the process's peak RSS over its RSS before the step, measured in
a fresh process after one warm-up step, so weights and optimizer state are
excluded), as a ratio to the full-batch step's.

    python benchmarks/bench_accum.py                # both settings, timing and memory
    python benchmarks/bench_accum.py --setting loss-heavy --repeats 9 --no-memory
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext
from types import SimpleNamespace

import torch

from naflex_accum.cached_loss import cached_loss_step
from naflex_accum.models import create_model
from naflex_accum.step import LOGIT_KEYS, AccumulationStep, train_step_eager
from naflex_accum.tasks import create_task

SETTINGS = {
    # narrow towers, large N: the N x N loss dominates (the measurement: embedding dim 512, N = 2048)
    "loss-heavy": dict(n=2048, seq_len=16, embed_dim=512, vision=("naflexvit_tiny_patch16_gap", 32),
                       text=dict(width=32, heads=2, layers=1), context=16),
    # ViT-S-like towers (width 384, 6 heads), N = 64: the towers dominate
    "tower-heavy": dict(n=64, seq_len=64, embed_dim=384, vision=("naflexvit_small_patch16_gap", 384),
                        text=dict(width=384, heads=6, layers=12), context=32),
}
KS = (1, 2, 4, 8)


class UpstreamStyleStep(AccumulationStep):
    """Upstream open_clip main's replay: per-replay scale, live logit parameters every replay, fresh RNG."""

    def replay_scale(self, window, j):
        if window.mode == "none":
            return 1.0
        ratio = window.microbatches[j].size / window.reference_batch_size
        return ratio ** 0.5 if window.mode == "sqrt" else ratio

    def logit_inputs(self, model_out, j, k):
        return {key: model_out[key] for key in LOGIT_KEYS if key in model_out}

    def replay_rng(self, microbatch):
        return nullcontext()


VARIANTS = {"upstream": UpstreamStyleStep(), "replay": train_step_eager, "cached-loss": cached_loss_step}


def build(setting: str):
    s = SETTINGS[setting]
    torch.manual_seed(0)
    cfg = {"embed_dim": s["embed_dim"],
           "vision_cfg": {"timm_model_name": s["vision"][0], "timm_pool": "avg", "timm_proj": "linear",
                          "image_size": 224},
           "text_cfg": {"context_length": s["context"], "vocab_size": 49408, **s["text"]}}
    task = create_task(create_model(cfg))
    task.train()
    g = torch.Generator().manual_seed(0)
    n, L = s["n"], s["seq_len"]
    side = int(L ** 0.5)
    coord = torch.stack(torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij"), -1).reshape(1, L, 2)
    image = {"patches": torch.randn(n, L, 768, generator=g), "patch_coord": coord.expand(n, L, 2).contiguous(),
             "patch_valid": torch.ones(n, L, dtype=torch.bool)}
    text = torch.randint(1, 49000, (n, s["context"]), generator=g)
    text[:, -1] = 49407
    return task, {"image": image, "text": text}


def split(batch, k):
    n = batch["text"].shape[0]
    bounds = [round(i * n / k) for i in range(k + 1)]

    def take(obj, lo, hi):
        return {key: take(v, lo, hi) for key, v in obj.items()} if isinstance(obj, dict) else obj[lo:hi]
    return [take(batch, lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])]


def one_step(task, optimizer, step_fn, microbatches, k):
    args = SimpleNamespace(accum_freq=k, batch_size=len(microbatches[0]["text"]), naflex_loss_scale="linear",
                           grad_clip_norm=None)
    state = ([], {}) if k > 1 else None
    for mb in microbatches:
        result = step_fn(task, mb, state, optimizer, None, nullcontext, args)
    assert result is not None


def plan(ks):
    """(label, step, k) for every timed variant; the full-batch step is k = 1 of our replay step."""
    rows = [("full", train_step_eager, 1)]
    rows += [(name, fn, k) for k in ks if k > 1 for name, fn in VARIANTS.items()]
    return rows


def time_setting(setting, ks, repeats, warmup):
    task, batch = build(setting)
    optimizer = torch.optim.AdamW(task.parameters(), lr=1e-5)
    rows = plan(ks)
    windows = {k: split(batch, k) for k in set(r[2] for r in rows)}
    times = {(label, k): [] for label, _, k in rows}
    for r in range(warmup + repeats):
        for label, fn, k in rows:  # interleaved, so drift hits every variant alike
            start = time.perf_counter()
            one_step(task, optimizer, fn, windows[k], k)
            if r >= warmup:
                times[(label, k)].append(time.perf_counter() - start)
    return {key: statistics.median(v) for key, v in times.items()}


def _rss_kb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def memory_probe(setting, label, k) -> int:
    """Peak RSS rise (KiB) during one steady-state step: runs in a fresh process."""
    task, batch = build(setting)
    optimizer = torch.optim.AdamW(task.parameters(), lr=1e-5)
    fn = train_step_eager if label == "full" else VARIANTS[label]
    window = split(batch, k)
    one_step(task, optimizer, fn, window, k)  # allocates gradients and optimizer state
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak-RSS mark (VmHWM) to the current RSS
    before = _rss_kb("VmRSS:")
    one_step(task, optimizer, fn, window, k)
    return _rss_kb("VmHWM:") - before


def memory_setting(setting, ks):
    out = {}
    for label, _, k in plan(ks):
        proc = subprocess.run([sys.executable, __file__, "--probe", setting, label, str(k)], capture_output=True,
                              text=True, timeout=1800, env={**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())})
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-2000:])
        out[(label, k)] = int(proc.stdout.strip().splitlines()[-1])
    return out


def report(setting, times, memory, ks):
    s = SETTINGS[setting]
    full_t, full_m = times[("full", 1)], memory.get(("full", 1)) if memory else None
    print(f"\n{setting}: N = {s['n']} samples per window, seq len {s['seq_len']}, embed dim {s['embed_dim']}; "
          f"full-batch step {full_t * 1000:.0f} ms" + (f", peak +{full_m / 1024:.0f} MiB" if full_m else ""))
    head = "| k | variant | step time vs full | vs upstream-style |" + (" peak memory vs full |" if memory else "")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for k in ks:
        if k == 1:
            continue
        for label in VARIANTS:
            t = times[(label, k)]
            cells = [str(k), label, f"{t / full_t:.2f}x", f"{t / times[('upstream', k)]:.2f}x"]
            if memory:
                cells.append(f"{memory[(label, k)] / full_m:.2f}x")
            print("| " + " | ".join(cells) + " |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setting", choices=(*SETTINGS, "both"), default="both")
    parser.add_argument("--ks", type=int, nargs="+", default=list(KS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--json", default=None, help="also write the raw numbers to this file")
    parser.add_argument("--probe", nargs=3, metavar=("SETTING", "VARIANT", "K"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.probe:
        print(memory_probe(args.probe[0], args.probe[1], int(args.probe[2])))
        return
    settings = list(SETTINGS) if args.setting == "both" else [args.setting]
    ks = sorted(set(args.ks) | {1})
    print(f"torch {torch.__version__}, {args.threads} thread(s), median of {args.repeats} interleaved repeats "
          f"after {args.warmup} warm-up")
    raw = {}
    for setting in settings:
        times = time_setting(setting, ks, args.repeats, args.warmup)
        memory = None if args.no_memory else memory_setting(setting, ks)
        report(setting, times, memory, ks)
        raw[setting] = {"times": {f"{a}@{k}": v for (a, k), v in times.items()},
                        "memory_kib": {f"{a}@{k}": v for (a, k), v in (memory or {}).items()}}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(raw, f, indent=1)


if __name__ == "__main__":
    main()
