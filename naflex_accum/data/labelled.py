"""Labelled images for zero-shot evaluation: webdataset shards or an ImageNet-style folder -> NaFlex batches.

Invariant: a pass yields every labelled image once, worker ``w`` of ``W`` taking items ``w, w + W, ...``,
batched exactly as training batches are; an unreadable image or label is skipped and counted in ``Problems``.
Labels: docs/training.md, "Zero-shot classification".
"""
import json
import os
from typing import Iterator, List, Optional, Tuple

import torch
from webdataset.tariterators import group_by_keys

from ..errors import UsageError, first_line
from .decode import decode_for_seq
from .patches import patchify_images
from .samples import IMAGE_EXTS, tar_members

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff", ".ppm", ".pgm")
IMAGENET_V2_SUBFOLDER = "imagenetv2-matched-frequency-format-val"  # where upstream's ImageNetV2Dataset looks
SHOWN_PROBLEMS = 3


class Problems:
    """Samples skipped in one pass: a count and the first few reasons."""

    def __init__(self):
        self.count, self.first = 0, []

    def add(self, reason: str):
        self.count += 1
        if len(self.first) < SHOWN_PROBLEMS:
            self.first.append(reason)


class ShardSource:
    """(image bytes, label) of webdataset shards; a label is the ``.cls`` index or ``json_label`` of the ``.json``."""

    def __init__(self, urls: List[str], classnames: List[str], json_label: Optional[str], flag: str):
        self.urls, self.json_label, self.flag = urls, json_label, flag
        self.index = {c: i for i, c in enumerate(classnames)}

    def __len__(self):
        return len(self.urls)

    def label(self, sample: dict) -> int:
        if self.json_label is not None:
            if "json" not in sample:
                raise ValueError("no .json member for json_label")
            fields = json.loads(sample["json"])
            name = self.json_label.format(**fields)
            if name not in self.index:
                raise ValueError(f"label {name!r} is not in the class list")
            return self.index[name]
        if "cls" not in sample:
            raise ValueError("no .cls member (a class index) and no json_label in the class list")
        label = int(sample["cls"].decode().strip())
        if not 0 <= label < len(self.index):
            raise ValueError(f".cls {label} is outside 0..{len(self.index) - 1}")
        return label

    def items(self, worker: int, workers: int, problems: Problems) -> Iterator[Tuple[bytes, int]]:
        for url in self.urls[worker::workers]:
            members = ({"fname": name, "data": data, "__url__": url} for name, data in tar_members(url))
            try:
                for sample in group_by_keys(members):
                    image = next((sample[e] for e in IMAGE_EXTS if e in sample), None)
                    try:
                        if image is None:
                            raise ValueError("no image member")
                        label = self.label(sample)
                    except (ValueError, KeyError, IndexError, UnicodeDecodeError) as exc:
                        problems.add(f"{url} key {sample['__key__']!r}: {exc}")
                        continue
                    yield image, label
            except Exception as exc:  # a truncated or garbage tar: keep what was read, report the rest
                problems.add(f"{url}: unreadable shard ({first_line(exc, named=True)})")


class FolderSource:
    """(image path, label) of an ImageNet-style folder: sorted class subfolders, or subfolders named by index."""

    def __init__(self, root: str, flag: str, numeric: bool, num_classes: int):
        if numeric and os.path.isdir(os.path.join(root, IMAGENET_V2_SUBFOLDER)):
            root = os.path.join(root, IMAGENET_V2_SUBFOLDER)
        if not os.path.isdir(root):
            raise UsageError(f"{flag} {root}: no such folder")
        classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
        if numeric:
            expected = [str(i) for i in range(num_classes)]
            if sorted(classes, key=lambda c: (len(c), c)) != expected:
                raise UsageError(f"{flag} {root}: expected subfolders 0..{num_classes - 1}, one per class; "
                                 f"found {len(classes)} folders")
        elif len(classes) != num_classes:
            raise UsageError(f"{flag} {root}: expected {num_classes} class subfolders (in sorted synset order); "
                             f"found {len(classes)}")
        self.files = [(os.path.join(root, c, f), int(c) if numeric else i)
                      for i, c in enumerate(classes) for f in sorted(os.listdir(os.path.join(root, c)))
                      if f.lower().endswith(IMAGE_SUFFIXES)]
        if not self.files:
            raise UsageError(f"{flag} {root}: no images ({', '.join(IMAGE_SUFFIXES)}) in its class subfolders")

    def __len__(self):
        return len(self.files)

    def items(self, worker: int, workers: int, problems: Problems) -> Iterator[Tuple[bytes, int]]:
        for path, label in self.files[worker::workers]:
            try:
                with open(path, "rb") as f:
                    yield f.read(), label
            except OSError as exc:
                problems.add(f"{path}: {exc}")


class LabelledBatches(torch.utils.data.IterableDataset):
    """``(NaFlex image batch, labels)`` of a source, built in the loader's workers; last yield is the problems.
    Images become patches exactly as training batches do (zero-shot accuracy on the pixels training sees)."""

    def __init__(self, source, seq_len: int, patch_size: int, batch_size: int, decode: str = "scaled",
                 flatten: bool = True):
        super().__init__()
        self.source, self.seq_len, self.patch_size, self.batch_size = source, seq_len, patch_size, batch_size
        self.decode, self.flatten = decode, flatten

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        problems, items, labels = Problems(), [], []
        for data, label in self.source.items(worker, workers, problems):
            try:
                items.append(decode_for_seq(data, self.seq_len, self.patch_size, self.decode))
            except Exception as exc:  # any undecodable image: skip and count it
                problems.add(f"undecodable image ({type(exc).__name__}: {exc})")
                continue
            labels.append(label)
            if len(items) == self.batch_size:
                yield patchify_images(items, self.seq_len, self.patch_size, self.flatten), torch.tensor(labels)
                items, labels = [], []
        if items:
            yield patchify_images(items, self.seq_len, self.patch_size, self.flatten), torch.tensor(labels)
        yield None, problems
