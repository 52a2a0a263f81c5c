"""The data pipeline on real photos: ours, upstream's loader and two decode floors, at seq lens 64, 256, 576.

The photo set is ``photo_shards.py``'s: 2,000 web-crawled-like JPEGs cut from the photos scikit-image
ships (aspect 1:2 to 2:1, long side 384-1,024 px, quality 75-95, 4:2:0), built once into
``~/.cache/naflex-accum/photos``. For each seq len one epoch is those same 2,000 samples (a fixed
seq len, batches of 250 / 50 / 25, so every loader delivers exactly the 2,000), each measurement a
fresh process (median of ``--repeats``, interleaved), CPU summed over the process and its workers:
  floor full    tar read + full decode (torchvision) + the resize to the NaFlex size, nothing else
  floor scaled  tar read + the DCT-scaled decode (``naflex_accum.data.decode``) + the same resize
  ours          naflex_accum's train loader (``--image-decode scaled``, the default), with no shuffle buffer
                so that it reads each of the 2,000 once, in the floors' order (checked by sample key)
  ours full     the same with ``--image-decode full``: the pipeline before the scaled decode
  ours + CPU normalise  ours, each batch's uint8 patches then normalised on the CPU in the same process
                (the trainer normalises on the training device; this is what a CPU-only run's training process
                adds; no target)
  upstream      upstream main's ``--use-naflex`` loader from the pinned snapshot (0 workers only)
Targets (0 workers unless said): ours >= 1.3x the full floor's images/s at seq 64 and >= 1.1x at 256;
at 576 no slower than ``ours full``; >= 4x upstream's images/s at 256; with 2 workers, ours' CPU per
image <= 1.2x the scaled floor's at every seq len, over the process's first epoch (which pays starting
the workers and their shared memory); each 2-worker process then runs a second epoch, whose CPU per image
(what every epoch of a long run pays) is printed beside it. Then how far the scaled decode moves the pixels
from the full decode + resize (PSNR, max abs error) and the normalised patches' per-channel mean and
spread (target: within 0.01 in normalised units, and 1% of the spread).

    python benchmarks/bench_data.py --photos [--repeats 3] [--workers 0 2]
"""
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from data_children import run_child
import photo_shards
import upstream_snapshot

NUM = 2000
BATCH = {64: 250, 256: 50, 576: 25}  # per seq len: batches that make exactly NUM
CONTEXT = 77
ZERO = ("floor full", "floor scaled", "ours", "ours full", "ours + CPU normalise", "upstream")
MORE = ("floor full", "floor scaled", "ours")
MEAN_TOL, SPREAD_TOL = 0.01, 0.01


def photo_data() -> str:
    """The shards' braceexpand pattern, built once (about 20 s)."""
    out = photo_shards.CACHE / f"shards-{NUM}"
    pattern = str(out / "photos-{000000..000003}.tar")
    if not (out / "photos-000003.tar").is_file():
        photo_shards.CACHE.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=photo_shards.CACHE))
        built = photo_shards.write_shards(tmp, NUM, NUM // 4)
        assert built.endswith("photos-{000000..000003}.tar"), built
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    return pattern


def _spec(name, data, seq, workers):
    kind = name.split()[0]
    decode = "full" if name.endswith("full") else "scaled"
    return dict(kind=kind, data=data, workers=workers, num_samples=NUM, seq_lens=[seq], budget=seq * BATCH[seq],
                divisor=1, context=CONTEXT, decode=decode, distinct=kind == "ours", sample_shuffle_size=0,
                normalize=name.endswith("normalise"),
                epochs=2 if workers and kind != "upstream" else 1)


def measure(data, repeats, workers_list, upstream_src):
    runs = {}
    for _ in range(repeats):  # interleaved, so load changes hit every row alike
        for seq in BATCH:
            for workers in workers_list:
                for name in ZERO if workers == 0 else MORE:
                    if name == "upstream" and upstream_src is None:
                        continue
                    started = time.perf_counter()
                    r = run_child(_spec(name, data, seq, workers), upstream_src)
                    print(f"  ({name}, seq {seq}, {workers} workers: {_rate(r):.0f} images/s; the child took "
                          f"{time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
                    if r["samples"] != NUM:
                        raise RuntimeError(f"{name} at seq {seq}, {workers} workers delivered {r['samples']} samples")
                    runs.setdefault((seq, workers, name), []).append(r)
    return runs


def _rate(r):
    return r["samples"] / r["wall"]


def _cpu_ms(r):
    return 1e3 * r["cpu"] / r["samples"]


def _next_cpu_ms(r):
    """CPU-ms per image of the second epoch in the same process: what each epoch of a long run costs."""
    return _cpu_ms(r["next"][0])


def paired(runs, a, b, value):
    """The median over repeats of value(a) / value(b), runs made next to each other."""
    return statistics.median(value(x) / value(y) for x, y in zip(runs[a], runs[b]))


def table(runs):
    print("| seq len | workers | loader | images/s | CPU-ms/image | CPU-ms/image, next epoch |")
    print("|---|---|---|---|---|---|")
    for (seq, workers, name), rs in runs.items():
        later = f"{statistics.median(map(_next_cpu_ms, rs)):.3f}" if rs[0].get("next") else "-"
        print(f"| {seq} | {workers} | {name} | {statistics.median(map(_rate, rs)):.0f} | "
              f"{statistics.median(map(_cpu_ms, rs)):.3f} | {later} |")
    print("(an epoch is one fresh process's first: it pays starting the workers and their shared memory; the "
          "next epoch, in the same process, is what each epoch of a long run pays)\n")


def verdicts(runs, workers_list):
    checks = []
    if 0 in workers_list:
        for seq, need in ((64, 1.3), (256, 1.1)):
            ratio = paired(runs, (seq, 0, "ours"), (seq, 0, "floor full"), _rate)
            checks.append((f"seq {seq}: ours images/s >= {need}x the full-decode floor's", ratio, ratio >= need))
        ratio = paired(runs, (576, 0, "ours"), (576, 0, "ours full"), _rate)
        checks.append(("seq 576: ours images/s >= 1.0x ours with --image-decode full", ratio, ratio >= 1.0))
        if (256, 0, "upstream") in runs:
            ratio = paired(runs, (256, 0, "ours"), (256, 0, "upstream"), _rate)
            checks.append(("seq 256: ours images/s >= 4x upstream's", ratio, ratio >= 4.0))
    later = []
    for workers in (w for w in workers_list if w > 0):
        for seq in BATCH:
            ratio = paired(runs, (seq, workers, "ours"), (seq, workers, "floor scaled"), _cpu_ms)
            checks.append((f"seq {seq}, {workers} workers: ours CPU/image <= 1.2x the scaled floor's", ratio,
                           ratio <= 1.2))
            later.append((seq, workers, paired(runs, (seq, workers, "ours"), (seq, workers, "floor scaled"),
                                               _next_cpu_ms)))
    print("Other ratios (paired medians):" if 0 in workers_list or later else "")
    for seq in BATCH if 0 in workers_list else ():
        parts = [f"ours / floor full {paired(runs, (seq, 0, 'ours'), (seq, 0, 'floor full'), _rate):.2f}x",
                 f"floor scaled / floor full "
                 f"{paired(runs, (seq, 0, 'floor scaled'), (seq, 0, 'floor full'), _rate):.2f}x",
                 f"ours / ours full {paired(runs, (seq, 0, 'ours'), (seq, 0, 'ours full'), _rate):.2f}x",
                 f"ours + CPU normalise / floor full "
                 f"{paired(runs, (seq, 0, 'ours + CPU normalise'), (seq, 0, 'floor full'), _rate):.2f}x"]
        if (seq, 0, "upstream") in runs:
            parts.append(f"ours / upstream {paired(runs, (seq, 0, 'ours'), (seq, 0, 'upstream'), _rate):.2f}x")
        print(f"  seq {seq}, 0 workers, images/s: " + "; ".join(parts))
    for seq, workers, ratio in later:
        print(f"  seq {seq}, {workers} workers, CPU/image in the next epoch (no start-up): ours / floor scaled "
              f"{ratio:.2f}x")
    print()
    for what, ratio, ok in checks:
        print(f"{'PASS' if ok else 'FAIL'}: {what}: {ratio:.2f}x")
    return all(ok for *_, ok in checks)


def pixels(data) -> bool:
    """PSNR / max abs error of the scaled path against the full one, and the normalised patches' statistics."""
    from braceexpand import braceexpand

    from naflex_accum.data.decode import dct_factor, decode_for_seq
    from naflex_accum.data.images import inspect
    from naflex_accum.data.samples import tar_members
    from naflex_accum.data.patches import IMAGE_MEAN, IMAGE_STD, size_for_seq

    torch.set_num_threads(1)
    blobs = [d for url in braceexpand(data) for n, d in tar_members(url) if n.endswith(".jpg")]
    mean, std = torch.tensor(IMAGE_MEAN)[:, None], torch.tensor(IMAGE_STD)[:, None]
    print(f"Scaled decode against full decode + resize, all {len(blobs)} photos (pixels 0-255; patch statistics "
          f"per channel R/G/B in normalised units):")
    print("| seq len | decoded at 1/1, 1/2, 1/4, 1/8 | PSNR | 5th pct. image PSNR | max abs | "
          "patch mean, full -> scaled | patch std, full -> scaled |")
    print("|---|---|---|---|---|---|---|")
    ok = True
    for seq in BATCH:
        factors, sq, n, worst, per_image = {1: 0, 2: 0, 4: 0, 8: 0}, 0.0, 0, 0, []
        sums = {mode: torch.zeros(3, 2, dtype=torch.float64) for mode in ("full", "scaled")}
        for blob in blobs:
            info = inspect(blob)
            factors[dct_factor((info.height, info.width), size_for_seq((info.height, info.width), 16, seq))] += 1
            full, scaled = (decode_for_seq(blob, seq, 16, mode) for mode in ("full", "scaled"))
            diff = full.int() - scaled.int()
            err = float((diff.double() ** 2).sum())
            sq, n, worst = sq + err, n + diff.numel(), max(worst, int(diff.abs().max()))
            per_image.append(10 * np.log10(255 ** 2 / max(err / diff.numel(), 1e-12)))
            for mode, img in (("full", full), ("scaled", scaled)):
                x = ((img.reshape(3, -1).double() / 255 - mean) / std)
                sums[mode] += torch.stack((x.sum(1), (x * x).sum(1)), 1)
        count = n / 3
        stats = {m: (s[:, 0] / count, (s[:, 1] / count - (s[:, 0] / count) ** 2).sqrt()) for m, s in sums.items()}
        d_mean = (stats["scaled"][0] - stats["full"][0]).abs().max().item()
        d_std = ((stats["scaled"][1] - stats["full"][1]).abs() / stats["full"][1]).max().item()
        ok = ok and d_mean <= MEAN_TOL and d_std <= SPREAD_TOL
        psnr = 10 * np.log10(255 ** 2 / (sq / n))
        fmt = lambda t: "/".join(f"{v:.3f}" for v in t.tolist())  # noqa: E731
        print(f"| {seq} | {', '.join(str(factors[f]) for f in (1, 2, 4, 8))} | {psnr:.1f} dB | "
              f"{np.percentile(per_image, 5):.1f} dB | {worst} | {fmt(stats['full'][0])} -> "
              f"{fmt(stats['scaled'][0])} | {fmt(stats['full'][1])} -> {fmt(stats['scaled'][1])} |")
        print(f"  (largest change: mean {d_mean:.4f}, std {100 * d_std:.2f}%)")
    print(f"\n{'PASS' if ok else 'FAIL'}: normalised patch mean within {MEAN_TOL} and spread within "
          f"{100 * SPREAD_TOL:.0f}% of the full decode's, every channel and seq len")
    return ok


def photos_main(args) -> int:
    data = photo_data()
    print(f"photos {data}; torch {torch.__version__}; {os.cpu_count()} CPUs; {NUM} samples per epoch; median of "
          f"{args.repeats} fresh processes; CPU summed over each process and its workers\n")
    src = upstream_snapshot.extract(args.upstream, required=False, what="bench_data --photos")
    runs = measure(data, args.repeats, args.workers, src and str(src))
    table(runs)
    ok = verdicts(runs, args.workers)
    print()
    ok = pixels(data) and ok
    return 0 if ok else 1
