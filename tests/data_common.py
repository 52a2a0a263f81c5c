"""Shared helpers for the data tests (tiny shards in tmp_path, a picklable tokenizer); no tests here."""
import io
import os
import tarfile

import torch

from naflex_accum.data import DataConfig
from naflex_accum.data.demo import write_demo_data

# Small images (seq lens up to 64 patches of 16 px) keep every test a few seconds on one CPU thread.
SEQ_LENS = (16, 36, 64)
BUDGET = 256


class CharTokenizer:
    """Captions as padded character codes: picklable, and invertible so tests can read captions back."""

    def __init__(self, context_length: int = 80):
        self.context_length = context_length

    def __call__(self, texts):
        out = torch.zeros(len(texts), self.context_length, dtype=torch.long)
        for i, text in enumerate(texts):
            codes = [ord(c) for c in text[:self.context_length]]
            out[i, :len(codes)] = torch.tensor(codes, dtype=torch.long)
        return out


def decode_text(tokens: torch.Tensor):
    return ["".join(chr(c) for c in row.tolist() if c) for row in tokens]


def demo(tmp_path, num=96, val=24, shard_size=16, seed=0):
    return write_demo_data(str(tmp_path / "demo"), num_samples=num, val_samples=val, seed=seed,
                           shard_size=shard_size, processes=1)


def config(train_data, **kw) -> DataConfig:
    base = dict(train_data=train_data, seq_lens=SEQ_LENS, max_tokens_per_batch=BUDGET, num_samples=120,
                workers=0, sample_shuffle_size=32)
    if "sample_shuffle_size" not in DataConfig.__dataclass_fields__:  # the code before exact epochs (red runs)
        base["shuffle_buffer"] = kw.pop("shuffle_buffer", base.pop("sample_shuffle_size"))
    base.update(kw)
    return DataConfig(**base)


def tar_members(path):
    with tarfile.open(path) as tar:
        return [(m.name, tar.extractfile(m).read()) for m in tar.getmembers()]


def write_tar(path, members):
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return str(path)


def shard_paths(pattern):
    from braceexpand import braceexpand
    paths = list(braceexpand(pattern))
    assert all(os.path.isfile(p) for p in paths)
    return paths


def reshard(source_pattern, sizes, out_dir, sizes_json=True):
    """The samples of ``source_pattern``'s shards, in order, repacked into shards of ``sizes`` samples each (the
    keys stay unique); with ``sizes_json`` an open_clip sizes.json beside them. Returns the braceexpand pattern."""
    import json

    samples, current, key = [], None, None
    for path in shard_paths(source_pattern):
        for name, data in tar_members(path):
            stem = name.split(".", 1)[0]
            if stem != key:
                key, current = stem, []
                samples.append(current)
            current.append((name, data))
    assert sum(sizes) <= len(samples), (sum(sizes), len(samples))
    os.makedirs(out_dir, exist_ok=True)
    listing, at = {}, 0
    for k, size in enumerate(sizes):
        name = f"part-{k:04d}.tar"
        write_tar(os.path.join(out_dir, name), [m for sample in samples[at:at + size] for m in sample])
        listing[name] = size
        at += size
    if sizes_json:
        with open(os.path.join(out_dir, "sizes.json"), "w") as f:
            json.dump(listing, f)
    return os.path.join(out_dir, f"part-{{0000..{len(sizes) - 1:04d}}}.tar")
