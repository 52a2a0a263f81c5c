"""Accumulation cost against upstream open_clip main's real step, on the CPU, in one process.

Upstream's ``open_clip_train.train._train_step_eager`` is loaded from the pinned
snapshot (``../shared/upstream/open_clip-89fb801.tar.gz`` from the checkout
root, extracted to a temporary folder whose ``src`` goes first on sys.path),
the models are built by upstream's factory (``open_clip.create_model`` with a
timm NaFlexVit tower, ``force_naflex_vision``) and wrapped in upstream's
``CLIPTask``; our steps run on the same objects. For a window of N samples in k
microbatches it times, with warm-up and interleaved repeats (the order rotates
each repeat), one torch thread by default (steadier than two on a small shared
machine), the median optimizer step of:
  full      upstream's step with accum_freq 1 over the N samples: the baseline, 1.00x
  upstream  upstream's step, accum_freq k
  replay    naflex_accum.replay_step (the window loss per microbatch, as upstream)
  default   naflex_accum.train_step_eager (cached-loss: the window loss once)
and prints each ratio against ``full`` and against ``upstream`` (the median of
the ratios paired within each repeat, so a slow spell hits both sides of a
ratio alike), the targets with PASS/FAIL, and (tower-heavy, k = 4) each step's peak memory: the rise of
the process's peak RSS (VmHWM, reset through /proc/self/clear_refs) over its
RSS before one steady-state step, measured in a fresh process per variant
after one warm-up step, so weights, gradients and optimizer state are
excluded. The probe runs with glibc's mmap threshold at 64 KiB and no trim
threshold, so every tensor's memory is mapped on allocation and unmapped on
free: RSS then follows torch's live allocations instead of malloc's cache.
The timing process keeps freed memory in glibc's heap (``mallopt``: no mmap'd
chunks, no trim), as torch's CUDA caching allocator keeps it on a GPU: with
glibc's defaults a step's activations are unmapped when freed and faulted in
again, zeroed, on the next step, which measured here 0.5 to 10 s of kernel time
per 12 s step, varying with the allocator's state rather than with the step.
The header prints the page faults left in the timed steps (``--system-malloc``
times with glibc's defaults).
``*-older`` are our steps in the older order of work (every microbatch cached, then every one replayed:
``naflex_accum.testing.older_order``), against the core step, whose last caching forward serves as its replay.

    python benchmarks/bench_accum.py             # both settings, k = 2 4 8, 5 / 15 repeats, memory
    python benchmarks/bench_accum.py --quick     # small models, k = 2 4, 1 repeat: a smoke run
    python benchmarks/bench_accum.py --setting loss-heavy --repeats 9 --no-memory

Without the snapshot it stops with one line, unless ``--stand-in``: then
``upstream`` is upstream's step re-stated (``naflex_accum.testing.bugs.upstream_style_step``)
on models from our own factory, and the output says so.
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import upstream_snapshot

SNAPSHOT = upstream_snapshot.SNAPSHOT
SRC_ENV = "NAFLEX_BENCH_UPSTREAM_SRC"  # set for memory probes: the extracted src, or "stand-in"

# (vision: timm NaFlexVit size, text tower, N samples per window, NaFlex sequence length, embed dim)
SETTINGS = {
    # ViT-S-like towers (width 384, 12 blocks), N = 64: the towers dominate
    "tower-heavy": dict(n=64, seq_len=64, embed_dim=384, vision=dict(embed_dim=384, depth=12, num_heads=6),
                        text=dict(width=384, heads=6, layers=12), context=32),
    # narrow towers, N = 1024, embed dim 512: the N x N loss dominates
    "loss-heavy": dict(n=1024, seq_len=16, embed_dim=512, vision=dict(embed_dim=32, depth=1, num_heads=2),
                       text=dict(width=32, heads=2, layers=1), context=16),
}
QUICK = {
    "tower-heavy": dict(n=16, seq_len=16, embed_dim=64, vision=dict(embed_dim=64, depth=2, num_heads=2),
                        text=dict(width=64, heads=2, layers=2), context=16),
    "loss-heavy": dict(n=256, seq_len=16, embed_dim=256, vision=dict(embed_dim=32, depth=1, num_heads=2),
                       text=dict(width=32, heads=2, layers=1), context=16),
}
# (setting, k, variant, baseline, at most): the targets, ratios of step times in one run
TARGETS = [("tower-heavy", 2, "default", "upstream", 0.90), ("tower-heavy", 4, "default", "upstream", 0.96),
           *[(s, k, "replay", "upstream", 1.0) for s in SETTINGS for k in (2, 4, 8)],
           ("loss-heavy", 4, "default", "upstream", 0.65)]
# Timed repeats per setting: a loss-heavy repeat costs ~1/30 of a tower-heavy one, and its
# replay-vs-upstream ratio sits near 1.0, so it gets more repeats to keep noise off the verdict.
REPEATS = {"tower-heavy": 5, "loss-heavy": 15}
MEMORY_VARIANTS = ("full", "upstream", "replay-older", "replay", "default-older", "default")
MEMORY_TARGET = ("tower-heavy", 4, "default", "default-older", 1.0)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4  # glibc's mallopt parameters (malloc.h)
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}  # RSS = live tensors


def load_upstream(stand_in: bool, snapshot: Path):
    """Put upstream's src first on sys.path (extracting the snapshot once); return (its step, its label)."""
    src = os.environ.get(SRC_ENV)
    if src is None and not stand_in:
        src = str(upstream_snapshot.extract(snapshot, what="bench_accum",
                                            hint="pass --upstream PATH to the open_clip-89fb801.tar.gz, or "
                                                 "--stand-in to time upstream's step as re-stated here"))
        os.environ[SRC_ENV] = src
    if stand_in or src == "stand-in":
        os.environ[SRC_ENV] = "stand-in"
        from naflex_accum.testing.bugs import upstream_style_step
        return upstream_style_step, "upstream-style stand-in (naflex_accum.testing.bugs; no snapshot)"
    sys.path.insert(0, src)
    import open_clip
    from open_clip_train.train import _train_step_eager
    return _train_step_eager, f"open_clip_train.train._train_step_eager from {src} (open_clip {open_clip.__version__})"


def build(setting: str, quick: bool):
    """(task, one batch of N samples): upstream's factory and CLIPTask, or ours for the stand-in."""
    import torch

    s = (QUICK if quick else SETTINGS)[setting]
    torch.manual_seed(0)
    vision = {"image_size": 224, "timm_model_name": "naflexvit_base_patch16_gap", "timm_model_pretrained": False,
              "timm_pool": "avg", "timm_proj": "linear", "timm_model_kwargs": {**s["vision"], "reg_tokens": 1}}
    cfg = {"embed_dim": s["embed_dim"], "vision_cfg": vision,
           "text_cfg": {"context_length": s["context"], "vocab_size": 49408, **s["text"]}}
    if os.environ.get(SRC_ENV) == "stand-in":
        from naflex_accum.models import create_model
        from naflex_accum.tasks import create_task
        size = "small" if s["vision"]["embed_dim"] >= 384 else "tiny"  # the NaFlexVit sizes models.py registers
        cfg["vision_cfg"] = {"timm_model_name": f"naflexvit_{size}_patch16_gap", "timm_pool": "avg",
                             "timm_proj": "linear", "image_size": 224}
        task = create_task(create_model(cfg))
    else:
        import open_clip
        from open_clip.task import CLIPTask
        with tempfile.TemporaryDirectory() as folder:
            with open(os.path.join(folder, "open_clip_config.json"), "w") as f:
                json.dump({"model_cfg": cfg}, f)
            model = open_clip.create_model(f"local-dir:{folder}", force_naflex_vision=True, output_dict=True)
        task = CLIPTask(model, verbose=False)
    task.train()
    return task, random_batch(s["n"], s["seq_len"], s["context"])


def random_batch(n, seq_len, context):
    import torch

    g = torch.Generator().manual_seed(0)
    side = int(seq_len ** 0.5)
    coord = torch.stack(torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij"), -1)
    coord = coord.reshape(1, side * side, 2).expand(n, -1, -1).contiguous()
    image = {"patches": torch.randn(n, side * side, 768, generator=g), "patch_coord": coord,
             "patch_valid": torch.ones(n, side * side, dtype=torch.bool)}
    text = torch.randint(1, 49000, (n, context), generator=g)
    text[:, -1] = 49407
    return {"image": image, "text": text}


def split(batch, k):
    n = batch["text"].shape[0]
    bounds = [round(i * n / k) for i in range(k + 1)]

    def take(obj, lo, hi):
        return {key: take(v, lo, hi) for key, v in obj.items()} if isinstance(obj, dict) else obj[lo:hi]
    return [take(batch, lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])]


def steps(upstream_step):
    """variant -> step function; ``*-older``: our modes in the previous order (every microbatch replayed)."""
    from naflex_accum import replay_step, train_step_eager
    from naflex_accum.testing.older_order import OlderCachedLossStep, OlderReplayStep

    older = {"replay-older": OlderReplayStep(), "default-older": OlderCachedLossStep()}
    return {"full": upstream_step, "upstream": upstream_step, "replay": replay_step, "default": train_step_eager,
            **older}


def one_step(task, optimizer, step_fn, microbatches, k):
    args = SimpleNamespace(accum_freq=k, batch_size=len(microbatches[0]["text"]), naflex_loss_scale="linear",
                           grad_clip_norm=None)
    state = ([], {}) if k > 1 else None
    for mb in microbatches:
        result = step_fn(task, mb, state, optimizer, None, nullcontext, args)
    assert result is not None


def hold_freed_memory() -> bool:
    """Keep freed memory in glibc's heap for reuse instead of returning it to the kernel; False if not glibc."""
    import ctypes

    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return all(mallopt(param, value) == 1 for param, value in
               ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2 ** 31 - 1), (M_TOP_PAD, 64 << 20)))


def page_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def time_setting(setting, ks, repeats, warmup, quick, fns, faults):
    """Every timed repeat of every (variant, k), in seconds; ``faults`` collects the timed steps' page faults."""
    import torch

    task, batch = build(setting, quick)
    optimizer = torch.optim.AdamW(task.parameters(), lr=1e-5)
    rows = [("full", 1)] + [(v, k) for k in ks for v in ("upstream", "replay", "default")]
    windows = {k: split(batch, k) for k in {1, *ks}}
    times = {row: [] for row in rows}
    for r in range(warmup + repeats):
        shift = r % len(rows)  # rotate the order: drift hits every variant alike
        for variant, k in rows[shift:] + rows[:shift]:
            flt, start = page_faults(), time.perf_counter()
            one_step(task, optimizer, fns[variant], windows[k], k)
            if r >= warmup:
                times[(variant, k)].append(time.perf_counter() - start)
                faults.append(page_faults() - flt)
    return times


def paired(times, row, base) -> float:
    """Median over repeats of ``row``'s time over ``base``'s in the same repeat."""
    return statistics.median(t / b for t, b in zip(times[row], times[base]))


def _status_kb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def memory_probe(setting, variant, k, quick, upstream_step) -> int:
    """Peak RSS rise (KiB) during one steady-state step of ``variant``: runs in a fresh process."""
    import torch

    task, batch = build(setting, quick)
    optimizer = torch.optim.AdamW(task.parameters(), lr=1e-5)
    k = 1 if variant == "full" else k
    window, fn = split(batch, k), steps(upstream_step)[variant]
    one_step(task, optimizer, fn, window, k)  # allocates gradients and optimizer state
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak-RSS mark (VmHWM) to the current RSS
    before = _status_kb("VmRSS:")
    one_step(task, optimizer, fn, window, k)
    return _status_kb("VmHWM:") - before


def memory_setting(setting, k, quick, threads):
    out = {}
    for variant in MEMORY_VARIANTS:
        cmd = [sys.executable, __file__, "--probe", setting, variant, str(k), "--threads", str(threads)]
        proc = subprocess.run(cmd + (["--quick"] if quick else []), capture_output=True, text=True, timeout=3600,
                              env={**os.environ, "OMP_NUM_THREADS": str(threads), **MALLOC_ENV})
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-2000:])
        out[variant] = int(proc.stdout.strip().splitlines()[-1])
    return out


def report(setting, times, ks, quick, stat):
    s = (QUICK if quick else SETTINGS)[setting]
    full = stat(times[("full", 1)])
    print(f"\n{setting}: N = {s['n']} samples per window, seq len {s['seq_len']}, embed dim {s['embed_dim']}, "
          f"vision width {s['vision']['embed_dim']} x {s['vision']['depth']}, text width {s['text']['width']} x "
          f"{s['text']['layers']}; full-batch step {full * 1000:.0f} ms")
    print("| k | variant | step (ms) | vs full | vs upstream |")
    print("|---|---|---|---|---|")
    for k in ks:
        for variant in ("upstream", "replay", "default"):
            row = (variant, k)
            print(f"| {k} | {variant} | {stat(times[row]) * 1000:.0f} | {paired(times, row, ('full', 1)):.2f}x | "
                  f"{paired(times, row, ('upstream', k)):.2f}x |")


def check_targets(all_times, memory):
    print("\n| target | measured | result |")
    print("|---|---|---|")
    failed = 0
    for setting, k, variant, base, limit in TARGETS:
        times = all_times.get(setting)
        if times is None or (variant, k) not in times:
            continue
        ratio = paired(times, (variant, k), (base, k))
        ok = ratio <= limit
        failed += not ok
        print(f"| {setting} k={k}: {variant} <= {limit:.2f}x {base} | {ratio:.3f}x | {'PASS' if ok else 'FAIL'} |")
    if memory:
        setting, k, variant, base, limit = MEMORY_TARGET
        # Whole MiB, as the table shows them: the new order adds the window's loss inputs (N x embed dim, a
        # few hundred KiB) to the last microbatch's activations, below what an RSS probe resolves reliably.
        ratio = round(memory[variant] / 1024) / round(memory[base] / 1024)
        failed += ratio > limit
        print(f"| {setting} k={k}: peak memory of {variant} <= {limit:.2f}x {base} (the older order), whole MiB | "
              f"{ratio:.3f}x ({memory[variant] - memory[base]:+d} KiB) | {'PASS' if ratio <= limit else 'FAIL'} |")
    return failed


def report_memory(setting, k, memory):
    print(f"\n{setting}, k = {k}: peak RSS rise during one steady-state step (fresh process per variant)")
    print("| variant | peak rise (MiB) | vs full | vs default-older |")
    print("|---|---|---|---|")
    for variant in MEMORY_VARIANTS:
        m = memory[variant]
        print(f"| {variant} | {m / 1024:.0f} | {m / memory['full']:.2f}x | {m / memory['default-older']:.2f}x |")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setting", choices=(*SETTINGS, "both"), default="both")
    parser.add_argument("--ks", type=int, nargs="+", default=None, help="microbatches per window (default 2 4 8)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed repeats (default 5 tower-heavy, 15 loss-heavy; --quick 1)")
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed rounds first (default 2: the heap grows to its steady size in them)")
    parser.add_argument("--system-malloc", action="store_true",
                        help="time with glibc's default malloc (freed memory unmapped and faulted in again)")
    parser.add_argument("--stat", choices=("median", "min"), default="median",
                        help="per-variant step time shown over the repeats (min: steadier on a shared machine)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: steadier on small machines)")
    parser.add_argument("--quick", action="store_true", help="small models, k = 2 4, one repeat: a smoke run")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--upstream", type=Path, default=SNAPSHOT, help="the pinned upstream snapshot (.tar.gz)")
    parser.add_argument("--stand-in", action="store_true", help="no snapshot: time upstream's step as re-stated")
    parser.add_argument("--json", default=None, help="also write the raw numbers to this file")
    parser.add_argument("--probe", nargs=3, metavar=("SETTING", "VARIANT", "K"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.repeats is not None and args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: give an integer >= 1")
    if args.warmup < 0:
        parser.error(f"--warmup {args.warmup}: give an integer >= 0")
    args.ks = args.ks or ([2, 4] if args.quick else [2, 4, 8])
    if args.quick:
        args.repeats = args.repeats or 1
    return args


def main():
    args = parse_args()
    upstream_step, label = load_upstream(args.stand_in, args.upstream)
    import torch

    torch.set_num_threads(args.threads)
    if args.probe:
        print(memory_probe(args.probe[0], args.probe[1], int(args.probe[2]), args.quick, upstream_step))
        return 0
    held = not args.system_malloc and hold_freed_memory()
    settings = list(SETTINGS) if args.setting == "both" else [args.setting]
    repeats = {s: args.repeats or REPEATS[s] for s in settings}
    quick = " (--quick: small models)" if args.quick else ""
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {args.stat} of "
          f"{', '.join(f'{n} ({s})' for s, n in repeats.items())} interleaved repeats after {args.warmup} "
          f"warm-up rounds{quick}\nupstream: {label}\nmalloc: "
          f"{'freed memory kept in the heap (mallopt)' if held else 'glibc defaults'}")
    fns, all_times, memory, faults = steps(upstream_step), {}, None, []
    stat = min if args.stat == "min" else statistics.median
    for setting in settings:
        all_times[setting] = time_setting(setting, args.ks, repeats[setting], args.warmup, args.quick, fns, faults)
        report(setting, all_times[setting], args.ks, args.quick, stat)
    print(f"\npage faults per timed step: median {statistics.median(faults):.0f}, max {max(faults)}")
    if not args.no_memory and "tower-heavy" in settings:
        memory = memory_setting("tower-heavy", 4, args.quick, torch.get_num_threads())
        report_memory("tower-heavy", 4, memory)
    failed = check_targets(all_times, memory)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({s: {f"{v}@{k}": ts for (v, k), ts in times.items()} for s, times in all_times.items()}
                      | {"memory_kib": memory or {}}, f, indent=1)
    print(f"\n{'all targets met' if not failed else f'{failed} target(s) missed'}"
          f"{' (small models: the targets are for the full settings)' if args.quick else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
