"""One data-loader measurement per fresh process, for ``bench_data.py`` (demo shards and ``--photos``).

``run_child(spec)`` runs this file with a JSON spec and returns what it printed: the samples and
image tokens delivered, the wall seconds and the CPU seconds of the process and its loader workers;
with ``epochs`` > 1 (floor, ours) the same for each later epoch of the same process under ``next``.
Kinds:
  floor     tar read + decode + resize, nothing else; ``decode`` "full" (torchvision, full size) or
            "scaled" (``naflex_accum.data.decode``: DCT-scaled JPEG decode, then the same resize)
  ours      naflex_accum's train loader (decode, resize, patchify, tokenize, collate, worker transfer),
            with ``--image-decode`` = ``decode``; its batches hold uint8 patches, which the trainer normalises on
            the training device; with ``normalize`` this process normalises each batch on the CPU as well
            (``naflex.normalize_patches``: what the training process of a CPU-only run adds)
  upstream  upstream main's ``--use-naflex`` webdataset loader from the pinned snapshot, built as its
            ``open_clip_train.main`` builds it (its src first on PYTHONPATH)
  resume-full / resume-skip   seconds to 90% of an epoch, producing or skipping what comes before
"""
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


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


def _our_loader(spec, workers=None):
    from open_clip.tokenizer import SimpleTokenizer

    from naflex_accum.data import DataConfig, make_train_loader

    cfg = DataConfig(train_data=spec["data"], seq_lens=tuple(spec["seq_lens"]), max_tokens_per_batch=spec["budget"],
                     batch_divisor=spec["divisor"], num_samples=spec["num_samples"],
                     workers=spec["workers"] if workers is None else workers, image_decode=spec.get("decode", "scaled"),
                     sample_shuffle_size=spec.get("sample_shuffle_size", 1000))
    return make_train_loader(cfg, SimpleTokenizer(context_length=spec["context"]))


class FloorStream(torch.utils.data.IterableDataset):
    """Reads shards (worker w takes every W-th) and decodes + resizes images to the schedule's sizes: nothing else."""

    def __init__(self, urls, seq_lens, decode):
        super().__init__()
        self.urls, self.seq_lens, self.decode = urls, seq_lens, decode

    def __iter__(self):
        from naflex_accum.data.decode import decode_for_seq
        from naflex_accum.data.samples import tar_members

        info = torch.utils.data.get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        seq_lens, urls = self.seq_lens[worker::workers], self.urls[worker::workers]
        count = tokens = 0
        while True:
            for url in urls:
                for name, data in tar_members(url):
                    if not name.endswith((".jpg", ".png")):
                        continue
                    img = decode_for_seq(data, seq_lens[count], 16, self.decode)
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


def _warm(decode):
    """Import what the first image needs, outside the timed part (every kind pays its imports before it)."""
    import importlib

    for name in ("torchvision.io", "torchvision.transforms.v2.functional"):
        importlib.import_module(name)
    if decode == "scaled":
        from naflex_accum.data.decode import _decoder
        _decoder()


def _epochs(spec, run_epoch):
    """``[((samples, tokens), wall, cpu)]`` for each of ``spec["epochs"]`` epochs (default 1), one after another
    in this process: the first pays the start-up (workers, shared memory), the next ones what a long run pays."""
    out = []
    for epoch in range(spec.get("epochs", 1)):
        cpu, wall = _cpu(), time.perf_counter()
        result = run_epoch(epoch)
        out.append((result, time.perf_counter() - wall, _cpu() - cpu))
    return out


def child_floor(spec):
    loader = _our_loader(spec, workers=0)
    seq_lens = [s.seq_len for s in loader.schedule(0) for _ in range(s.batch_size)]
    dataset = FloorStream(loader.index.urls, seq_lens, spec["decode"])
    workers = spec["workers"]
    _warm(spec["decode"])

    def epoch(_):  # a DataLoader without persistent workers starts its workers at every epoch
        source = dataset if workers == 0 else torch.utils.data.DataLoader(dataset, batch_size=None,
                                                                          num_workers=workers)
        return _drain(iter(source), lambda item: (int(item["samples"]), int(item["tokens"])))
    return _epochs(spec, epoch)


def child_ours(spec):
    loader = _our_loader(spec)
    _warm(spec.get("decode", "scaled"))

    from naflex_accum.data.patches import normalize_patches

    def epoch(index):
        keys = set()

        def count(item):
            keys.update(item[1]["keys"])
            if spec.get("normalize"):
                normalize_patches(item[0]["image"])
            return item[1]["samples"], item[1]["image_tokens"]
        loader.set_epoch(index)
        result = _drain(loader.iter_meta(), count)
        if spec.get("distinct") and len(keys) != result[0]:
            raise RuntimeError(f"ours delivered {result[0]} samples but {len(keys)} distinct ones")
        return result
    return _epochs(spec, epoch)


def child_upstream(spec):
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
    args = parse_args(["--use-naflex", "--model", "naflex_ViT-B-16", "--train-data", spec["data"], "--dataset-type",
                       "webdataset", "--train-num-samples", str(spec["num_samples"]), "--naflex-seq-lens",
                       *map(str, spec["seq_lens"]), "--naflex-max-tokens-per-batch", str(spec["budget"]),
                       "--naflex-batch-divisor", str(spec["divisor"]), "--workers", str(spec["workers"]),
                       "--seed", "0"])
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
    assert tokenizer.context_length == spec["context"]
    info = get_data(args, (preprocess_train, preprocess_val), epoch=0, tokenizer=tokenizer,
                    naflex_data_config=naflex_cfg)["train"]
    info.set_epoch(0)
    cpu, wall = _cpu(), time.perf_counter()
    iterator = iter(info.dataloader)

    def count(batch):
        valid = batch["image"]["patch_valid"]
        return valid.shape[0], int(valid.sum())
    result = _drain(iterator, count)
    return [(result, time.perf_counter() - wall, _cpu() - cpu)]


def child_resume(spec, skip):
    """Seconds to batch ``start`` (90% of the epoch), skipping to it or producing every batch before it, and
    to the first batch the loader yields (what starting any epoch costs: workers, the shuffle buffer's fill).

    Both are read when the batch arrives: leaving the loop shuts the workers down (about 0.08 s with 2),
    which is no part of reaching the batch.
    """
    loader = _our_loader(spec)
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
    return {"first": first, "start": start, "wall": reached, "cpu": _cpu() - cpu}


def run_child(spec: dict, upstream_src=None) -> dict:
    """``spec``: kind, data, workers, num_samples, seq_lens, budget, divisor, context (and decode, distinct)."""
    env = dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [upstream_src if spec["kind"] == "upstream" else None,
                                                      str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, __file__, json.dumps(spec)], env=env, capture_output=True, text=True,
                          cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{spec['kind']} (workers {spec['workers']}) failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(spec):
    torch.set_num_threads(1)
    kind = spec["kind"]
    if kind.startswith("resume"):
        return print(json.dumps(child_resume(spec, skip=kind == "resume-skip")))
    runs = globals()[f"child_{kind}"](spec)  # one (result, wall, cpu) per epoch
    (samples, tokens), wall, cpu = runs[0]
    later = [{"samples": s, "tokens": t, "wall": w, "cpu": c} for (s, t), w, c in runs[1:]]
    print(json.dumps({"samples": samples, "tokens": tokens, "wall": wall, "cpu": cpu, "next": later}))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
