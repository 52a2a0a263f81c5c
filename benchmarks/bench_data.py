"""The NaFlex webdataset pipeline against its decode floor and upstream open_clip main's NaFlex loader.

One run, the same demo shards, the demo's schedule (sequence lengths 16/36/64, a
2,048-token budget, batch divisor 4, patch 16, context 77), one epoch of
``--num-samples`` samples, each measurement a fresh process (median of
``--repeats``, interleaved), CPU time summed over the process and its loader
workers, for 0 and 2 workers:
  floor     tar read + decode + resize only (the chosen decoder, torchvision), nothing else
  ours      naflex_accum's train loader (decode, resize, patchify, tokenize, collate, worker transfer)
  upstream  upstream main's ``--use-naflex`` webdataset loader from the pinned snapshot, built as its
            ``open_clip_train.main`` builds it (its src first on PYTHONPATH, in a subprocess)
Targets: ours <= 1.3x the floor's CPU-ms per sample; ours >= 2.5x upstream's samples/s with 0 workers.
Ratios are medians over runs made next to each other. Then the decoders on the demo images (cost of
decode + resize, difference to Pillow's), and the mid-epoch resume (a 10,000-sample epoch): the time to
batch 90% when resuming there over the time to produce the first 90%, both net of what the first batch
of any epoch costs (target <= 0.10).

    python benchmarks/bench_data.py [--data-dir DIR] [--num-samples 4000] [--repeats 3]
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
UPSTREAM = ROOT.parent / "shared" / "upstream" / "open_clip-89fb801.tar.gz"
SEQ_LENS, BUDGET, DIVISOR, CONTEXT = (16, 36, 64), 2048, 4, 77
KINDS = ("floor", "ours", "upstream")


def _cpu() -> float:
    """CPU seconds of this process and its children: joined ones from rusage, live ones (workers) from /proc."""
    import multiprocessing

    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime
    for child in multiprocessing.active_children():  # persistent workers are never joined in the run
        try:
            with open(f"/proc/{child.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            pass
    return total


def _our_loader(data, workers, num_samples):
    from open_clip.tokenizer import SimpleTokenizer

    from naflex_accum.data import DataConfig, make_train_loader

    cfg = DataConfig(train_data=data, seq_lens=SEQ_LENS, max_tokens_per_batch=BUDGET, batch_divisor=DIVISOR,
                     num_samples=num_samples, workers=workers)
    return make_train_loader(cfg, SimpleTokenizer(context_length=CONTEXT))


class FloorStream(torch.utils.data.IterableDataset):
    """Reads shards (worker w takes every W-th) and decodes + resizes images to the schedule's sizes: nothing else."""

    def __init__(self, urls, seq_lens):
        super().__init__()
        self.urls, self.seq_lens = urls, seq_lens

    def __iter__(self):
        from naflex_accum.data.images import decode_rgb
        from naflex_accum.data.samples import tar_members
        from naflex_accum.naflex import resize_for_seq

        info = torch.utils.data.get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        seq_lens, urls = self.seq_lens[worker::workers], self.urls[worker::workers]
        count = tokens = 0
        while True:
            for url in urls:
                for name, data in tar_members(url):
                    if not name.endswith((".jpg", ".png")):
                        continue
                    img = resize_for_seq(decode_rgb(data), seq_lens[count], 16)
                    tokens += (img.shape[1] // 16) * (img.shape[2] // 16)
                    count += 1
                    if count == len(seq_lens):
                        yield {"samples": count, "tokens": tokens}
                        return


def _drain(iterator, count):
    samples = tokens = 0
    for item in iterator:
        s, t = count(item)
        samples, tokens = samples + s, tokens + t
    return samples, tokens


def child_floor(data, workers, num_samples):
    loader = _our_loader(data, 0, num_samples)
    seq_lens = [s.seq_len for s in loader.schedule(0) for _ in range(s.batch_size)]
    dataset = FloorStream(loader.urls, seq_lens)
    cpu, wall = _cpu(), time.perf_counter()
    source = dataset if workers == 0 else torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=workers)
    result = _drain(iter(source), lambda item: (int(item["samples"]), int(item["tokens"])))
    return result, time.perf_counter() - wall, _cpu() - cpu


def child_ours(data, workers, num_samples):
    loader = _our_loader(data, workers, num_samples)
    loader.set_epoch(0)
    cpu, wall = _cpu(), time.perf_counter()
    result = _drain(loader.iter_meta(), lambda item: (item[1]["samples"], item[1]["image_tokens"]))
    return result, time.perf_counter() - wall, _cpu() - cpu


def child_upstream(data, workers, num_samples):
    # Upstream's group_by_keys expects its pinned webdataset (<= 0.2.86, the test extra's); webdataset >= 1.0
    # ends each shard with an empty marker it does not know. With 1.0 this restores 0.2.86's behaviour.
    import functools
    import inspect

    import webdataset.tariterators as wds_tar
    if "eof_value" in inspect.signature(wds_tar.tar_file_expander).parameters:
        wds_tar.tar_file_expander = functools.partial(wds_tar.tar_file_expander, eof_value=None)
    from open_clip import create_model_and_transforms, get_tokenizer
    from open_clip_train.data import get_data
    from open_clip_train.naflex_data import (create_naflex_data_config_from_args, get_naflex_model_image_seq_len,
                                             get_naflex_model_patch_size)
    from open_clip_train.params import parse_args

    # what open_clip_train.main does up to get_data, on the CPU, one process
    args = parse_args(["--use-naflex", "--model", "naflex_ViT-B-16", "--train-data", data, "--dataset-type",
                       "webdataset", "--train-num-samples", str(num_samples), "--naflex-seq-lens",
                       *map(str, SEQ_LENS), "--naflex-max-tokens-per-batch", str(BUDGET),
                       "--naflex-batch-divisor", str(DIVISOR), "--workers", str(workers), "--seed", "0"])
    args.distributed, args.rank, args.world_size, args.local_rank, args.device = False, 0, 1, 0, "cpu"
    model, preprocess_train, preprocess_val = create_model_and_transforms(
        args.model, args.pretrained, precision=args.precision, device=args.device,
        force_image_size=args.force_image_size, force_context_length=args.force_context_length,
        image_mean=args.image_mean, image_std=args.image_std, image_interpolation=args.image_interpolation,
        image_resize_mode=args.image_resize_mode, aug_cfg=args.aug_cfg,
        force_naflex_vision=args.force_naflex_vision, output_dict=True)
    naflex_cfg = create_naflex_data_config_from_args(args, default_patch_size=get_naflex_model_patch_size(model),
                                                     default_eval_seq_len=get_naflex_model_image_seq_len(model))
    tokenizer = get_tokenizer(args.model, context_length=args.force_context_length)
    assert tokenizer.context_length == CONTEXT
    info = get_data(args, (preprocess_train, preprocess_val), epoch=0, tokenizer=tokenizer,
                    naflex_data_config=naflex_cfg)["train"]
    info.set_epoch(0)
    cpu, wall = _cpu(), time.perf_counter()
    iterator = iter(info.dataloader)

    def count(batch):
        valid = batch["image"]["patch_valid"]
        return valid.shape[0], int(valid.sum())
    result = _drain(iterator, count)
    return result, time.perf_counter() - wall, _cpu() - cpu


def child_resume(data, workers, num_samples, skip):
    """Seconds to batch ``start`` (90% of the epoch), skipping to it or producing every batch before it, and
    to the first batch the loader yields (what starting any epoch costs: workers, the shuffle buffer's fill).

    Both are read when the batch arrives: leaving the loop shuts the workers down (about 0.08 s with 2),
    which is no part of reaching the batch.
    """
    loader = _our_loader(data, workers, num_samples)
    start = round(0.9 * loader.num_batches)
    loader.set_epoch(0, start if skip else 0)
    cpu, wall = _cpu(), time.perf_counter()
    first = reached = None
    for _, meta in loader.iter_meta():
        now = time.perf_counter() - wall
        first = now if first is None else first
        if meta["index"] >= start:
            reached = now
            break
    return (first, start), reached, _cpu() - cpu


def run_child(kind, data, workers, num_samples, upstream_src=None):
    env = dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS="1")
    if kind == "upstream":
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [upstream_src, env.get("PYTHONPATH")]))
    cmd = [sys.executable, __file__, "--child", kind, "--data", data, "--workers", str(workers),
           "--num-samples", str(num_samples)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} (workers {workers}) failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def child_main(args):
    torch.set_num_threads(1)
    kind, data, workers, n = args.child, args.data, args.workers[0], args.num_samples
    if kind.startswith("resume"):
        (first, start), wall, cpu = child_resume(data, workers, n, skip=kind == "resume-skip")
        return print(json.dumps({"first": first, "start": start, "wall": wall, "cpu": cpu}))
    else:
        (samples, tokens), wall, cpu = globals()[f"child_{kind}"](data, workers, n)
    print(json.dumps({"samples": samples, "tokens": tokens, "wall": wall, "cpu": cpu}))


def pipeline_table(data, args, upstream_src):
    runs = {(k, w): [] for k in KINDS for w in args.workers}
    for _ in range(args.repeats):  # interleaved, so load changes hit every row alike
        for workers in args.workers:
            for kind in KINDS:
                if kind == "upstream" and upstream_src is None:
                    continue
                runs[kind, workers].append(run_child(kind, data, workers, args.num_samples, upstream_src))
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
    from naflex_accum.naflex import resize_for_seq, size_for_seq

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
                rows.setdefault((kind, workers), []).append(run_child(kind, data, workers, n))
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


def extract_upstream(tmp, archive: Path):
    if not archive.is_file():
        print(f"(no {archive}: upstream rows skipped)")
        return None
    with tarfile.open(archive) as tar:
        tar.extractall(tmp, filter="data")
    return str(next(Path(tmp).glob("open_clip-*")) / "src")


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
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child_main(args)
    from naflex_accum.commands.demo import default_data_dir, ensure_demo_data

    data = ensure_demo_data(args.data_dir or default_data_dir(), 10000, 1000)["train"]
    print(f"demo data {data}; torch {torch.__version__}; {os.cpu_count()} CPUs; {args.num_samples} samples per "
          f"epoch; median of {args.repeats} fresh processes; CPU summed over each process and its workers\n")
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        if "pipeline" in args.only:
            ok = pipeline_table(data, args, extract_upstream(tmp, args.upstream)) and ok
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
