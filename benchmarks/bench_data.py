"""The NaFlex webdataset pipeline against its decode floor and upstream open_clip main's NaFlex loader.

One run, the same demo shards, the demo's schedule (sequence lengths 16/36/64, a
2,048-token budget, batch divisor 4, patch 16, context 77), one epoch of
``--num-samples`` samples, each measurement a fresh process (median of
``--repeats``, interleaved), CPU time summed over the process and its loader
workers, for 0 and 2 workers:
  floor     tar read + full decode (torchvision) + resize only, nothing else
  ours      naflex_accum's train loader (decode, resize, patchify, tokenize, collate, worker transfer)
  upstream  upstream main's ``--use-naflex`` webdataset loader from the pinned snapshot, built as its
            ``open_clip_train.main`` builds it (its src first on PYTHONPATH, in a subprocess)
Targets: ours <= 1.3x the floor's CPU-ms per sample; ours >= 2.5x upstream's samples/s with 0 workers.
Ratios are medians over runs made next to each other. Then the decoders on the demo images (cost of
decode + resize, difference to Pillow's), and the mid-epoch resume (a 10,000-sample epoch): the time to
batch 90% when resuming there over the time to produce the first 90%, both net of what the first batch
of any epoch costs (target <= 0.10).

    python benchmarks/bench_data.py [--data-dir DIR] [--num-samples 4000] [--repeats 3]
    python benchmarks/bench_data.py --photos [--repeats 3]   # real photos: see bench_photos.py
"""
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data_children import run_child  # noqa: E402
import upstream_snapshot  # noqa: E402

UPSTREAM = upstream_snapshot.SNAPSHOT
SEQ_LENS, BUDGET, DIVISOR, CONTEXT = (16, 36, 64), 2048, 4, 77
KINDS = ("floor", "ours", "upstream")


def _spec(kind, data, workers, num_samples, **extra):
    return dict(kind=kind, data=data, workers=workers, num_samples=num_samples, seq_lens=list(SEQ_LENS),
                budget=BUDGET, divisor=DIVISOR, context=CONTEXT, decode="full" if kind == "floor" else "scaled",
                **extra)


def pipeline_table(data, args, upstream_src):
    runs = {(k, w): [] for k in KINDS for w in args.workers}
    for _ in range(args.repeats):  # interleaved, so load changes hit every row alike
        for workers in args.workers:
            for kind in KINDS:
                if kind == "upstream" and upstream_src is None:
                    continue
                runs[kind, workers].append(run_child(_spec(kind, data, workers, args.num_samples), upstream_src))
    med = {}
    for key, rs in runs.items():
        if rs:
            med[key] = {m: statistics.median(r[m] / r["wall"] if m != "cpu" else 1e3 * r["cpu"] / r["samples"]
                                             for r in rs) for m in ("samples", "tokens", "cpu")}
    print("| loader | workers | samples/s | image tokens/s | CPU-ms/sample |")
    print("|---|---|---|---|---|")
    for workers in args.workers:
        for kind in KINDS:
            if (kind, workers) in med:
                m = med[kind, workers]
                print(f"| {kind} | {workers} | {m['samples']:.0f} | {m['tokens']:.0f} | {m['cpu']:.3f} |")
    print()
    def paired(a, b, metric):  # the median ratio of runs made next to each other: steadier under load
        def value(r):
            return r["cpu"] / r["samples"] if metric == "cpu" else r["samples"] / r["wall"]
        return statistics.median(value(x) / value(y) for x, y in zip(runs[a], runs[b]))

    verdicts = []
    for workers in args.workers:
        ratio = paired(("ours", workers), ("floor", workers), "cpu")
        verdicts.append((f"ours CPU-ms/sample <= 1.3x the floor's, {workers} workers", ratio, ratio <= 1.3))
    if runs.get(("upstream", 0)):
        ratio = paired(("ours", 0), ("upstream", 0), "samples")
        verdicts.append(("ours samples/s >= 2.5x upstream's, 0 workers", ratio, ratio >= 2.5))
    for what, ratio, ok in verdicts:
        print(f"{'PASS' if ok else 'FAIL'}: {what}: {ratio:.2f}x")
    return all(ok for *_, ok in verdicts)


def decoders_table(data, count=600, repeats=3):
    """Decode + resize cost per image and the mean absolute difference to Pillow's full decode + bicubic."""
    import io

    import numpy as np
    from braceexpand import braceexpand
    from PIL import Image

    from naflex_accum.data.images import decode_rgb
    from naflex_accum.data.samples import tar_members
    from naflex_accum.data.patches import resize_for_seq, size_for_seq

    blobs = [d for n, d in tar_members(next(iter(braceexpand(data)))) if n.endswith((".jpg", ".png"))][:count]
    seq_lens = [SEQ_LENS[k % len(SEQ_LENS)] for k in range(len(blobs))]

    def pillow(blob, seq_len, draft=False):
        img = Image.open(io.BytesIO(blob))
        h, w = size_for_seq((img.height, img.width), 16, seq_len)
        if draft and img.format == "JPEG":
            img.draft("RGB", (w, h))
        img = img.convert("RGB")
        return np.asarray(img if img.size == (w, h) else img.resize((w, h), Image.BICUBIC))

    def ours(blob, seq_len):
        return resize_for_seq(decode_rgb(blob), seq_len, 16).permute(1, 2, 0).numpy()

    def draft_tensor(blob, seq_len):  # Pillow's reduced-scale JPEG decode feeding the uint8 tensor resize
        from torchvision.transforms import InterpolationMode
        from torchvision.transforms.v2.functional import resize_image

        img = Image.open(io.BytesIO(blob))
        h, w = size_for_seq((img.height, img.width), 16, seq_len)
        img.draft("RGB", (w, h))
        rgb = torch.from_numpy(np.array(img.convert("RGB"))).permute(2, 0, 1)
        return resize_image(rgb, [h, w], interpolation=InterpolationMode.BICUBIC, antialias=True) \
            .permute(1, 2, 0).numpy()

    decoders = {"torchvision decode + uint8 resize (ours)": ours,
                "Pillow draft decode + uint8 resize": draft_tensor,
                "Pillow draft + Pillow resize (before)": lambda b, s: pillow(b, s, draft=True),
                "Pillow full decode + Pillow resize (reference)": pillow}
    try:  # optional: pip install simplejpeg
        import simplejpeg

        def scaled(blob, seq_len):
            if not blob.startswith(b"\xff\xd8"):
                return ours(blob, seq_len)
            from torchvision.transforms import InterpolationMode
            from torchvision.transforms.v2.functional import resize_image

            h, w = size_for_seq(tuple(simplejpeg.decode_jpeg_header(blob)[:2]), 16, seq_len)
            rgb = torch.from_numpy(simplejpeg.decode_jpeg(blob, colorspace="RGB", min_height=h, min_width=w))
            out = resize_image(rgb.permute(2, 0, 1), [h, w], interpolation=InterpolationMode.BICUBIC, antialias=True)
            return out.permute(1, 2, 0).numpy()
        decoders["simplejpeg scaled decode + uint8 resize"] = scaled
    except ImportError:
        pass
    reference = [pillow(b, s) for b, s in zip(blobs, seq_lens)]
    times = {name: [] for name in decoders}
    for _ in range(repeats):
        for name, fn in decoders.items():
            start = time.process_time()
            for b, s in zip(blobs, seq_lens):
                fn(b, s)
            times[name].append((time.process_time() - start) / len(blobs) * 1e3)
    print(f"| decoder ({len(blobs)} demo images) | CPU-ms/image | mean abs diff to Pillow (1/255) | worst image |")
    print("|---|---|---|---|")
    for name, fn in decoders.items():
        diffs = [np.abs(fn(b, s).astype(np.int16) - r.astype(np.int16)).mean()
                 for b, s, r in zip(blobs, seq_lens, reference)]
        print(f"| {name} | {statistics.median(times[name]):.3f} | {np.mean(diffs):.3f} | {np.max(diffs):.3f} |")


def resume_table(data, args):
    n = args.resume_samples
    rows = {}
    for _ in range(args.repeats):
        for workers in args.workers:
            for kind in ("resume-full", "resume-skip"):
                rows.setdefault((kind, workers), []).append(run_child(_spec(kind, data, workers, n)))
    print(f"Resuming at batch {rows['resume-full', args.workers[0]][0]['start']} (90%) of a {n}-sample epoch, "
          f"seconds to that batch (median of {args.repeats}); 'net' leaves out what starting any epoch costs "
          f"(the first batch of a fresh epoch: workers, the shuffle buffer's fill):")
    print("| workers | epoch start | producing the first 90% | resuming at 90% | ratio | ratio, net |")
    print("|---|---|---|---|---|---|")
    ok = True
    for workers in args.workers:
        full, skip = rows["resume-full", workers], rows["resume-skip", workers]
        first = statistics.median(r["first"] for r in full)
        t_full, t_skip = statistics.median(r["wall"] for r in full), statistics.median(r["wall"] for r in skip)
        net = max(t_skip - first, 0.0) / (t_full - first)
        ok = ok and net <= 0.10
        print(f"| {workers} | {first:.2f} s | {t_full:.2f} s | {t_skip:.2f} s | {t_skip / t_full:.3f} | {net:.3f} |")
    print(f"\n{'PASS' if ok else 'FAIL'}: resuming at 90% costs <= 0.10x producing the first 90% (net)")
    return ok


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=None, help="demo data (made if missing)")
    parser.add_argument("--num-samples", type=int, default=4000, help="samples per epoch")
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per row (median)")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--upstream", type=Path, default=UPSTREAM, help="the pinned upstream snapshot (.tar.gz)")
    parser.add_argument("--resume-samples", type=int, default=10000, help="epoch size of the resume measurement")
    parser.add_argument("--only", choices=("pipeline", "decoders", "resume"), nargs="+",
                        default=["pipeline", "decoders", "resume"])
    parser.add_argument("--photos", action="store_true",
                        help="real photos instead (bench_photos.py): seq lens 64/256/576, the same 2,000 samples")
    args = parser.parse_args()
    if args.photos:
        from bench_photos import photos_main
        return photos_main(args)
    from naflex_accum.commands.demo import default_data_dir, ensure_demo_data

    data = ensure_demo_data(args.data_dir or default_data_dir(), 10000, 1000)["train"]
    print(f"demo data {data}; torch {torch.__version__}; {os.cpu_count()} CPUs; {args.num_samples} samples per "
          f"epoch; median of {args.repeats} fresh processes; CPU summed over each process and its workers\n")
    ok = True
    if "pipeline" in args.only:
        src = upstream_snapshot.extract(args.upstream, required=False, what="bench_data")
        ok = pipeline_table(data, args, src and str(src)) and ok
        print()
    if "decoders" in args.only:
        torch.set_num_threads(1)
        decoders_table(data)
        print()
    if "resume" in args.only:
        ok = resume_table(data, args) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
