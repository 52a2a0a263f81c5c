"""The worker side: raw samples -> NaFlex batches, one stream per (rank, worker).

Invariant: worker w of W builds exactly the batches i of the epoch's schedule
with ``i % W == w``, in order (torch's DataLoader round-robin), each filled to
its scheduled size from the worker's sample stream, whose order is a pure
function of ``(seed, epoch, rank, worker)`` and never of the batch sizes: a
sample that fails to decode is skipped (and reported) and the batch takes the
next one. Every yield is ``(batch, meta)``: the batch has exactly the keys the
model takes, and ``meta`` carries the index and this batch's counts (samples,
image tokens, corrupt samples and their messages) back to the main process.
A ``UsageError`` in a worker is sent back as ``(None, {"error": message})`` so the
main process can raise it as one clean line.
"""
import random
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from ..errors import UsageError
from ..naflex import collate_uint8_patches, pil_to_patches
from .samples import Corruption, RawSample, sample_stream, shard_samples, shuffled
from .schedule import BatchSpec, Schedule, derive_seed
from .shards import shard_order

# Consecutive undecodable images before giving up: only a data set with no decodable image gets there.
MAX_CONSECUTIVE_FAILURES = 1000


def decode_samples(samples: Iterator[RawSample], count: int, seq_len: int, patch_size: int, flatten: bool,
                   report: Corruption, flag: str) -> Tuple[List[Dict], List[str]]:
    """Up to ``count`` decoded samples (fewer only if ``samples`` ends); failures are skipped and reported."""
    items, captions, failures = [], [], 0
    while len(items) < count:
        raw = next(samples, None)
        if raw is None:
            break
        try:
            items.append(pil_to_patches(raw.image, seq_len, patch_size, flatten))
        except Exception as exc:  # truncated data, bad PNG chunks, decompression bombs: all "skip this one"
            report.add(raw.url, raw.key, f"undecodable image ({type(exc).__name__}: {exc})")
            failures += 1
            if failures >= MAX_CONSECUTIVE_FAILURES:
                raise UsageError(f"{flag}: {failures} images in a row failed to decode; last: {report.last}")
            continue
        finally:
            raw.image.close()
        failures = 0
        captions.append(raw.caption)
    return items, captions


def make_batch(items: List[Dict], captions: List[str], seq_len: int, tokenizer: Callable) -> Dict:
    text = tokenizer(captions)
    if not isinstance(text, torch.Tensor):
        text = torch.as_tensor(text)
    return {"image": collate_uint8_patches(items, seq_len), "text": text.long()}


def batch_meta(index: int, batch: Dict, report: Corruption) -> Dict:
    corrupt, messages = report.drain()
    valid = batch["image"]["patch_valid"]
    return {"index": index, "samples": int(valid.shape[0]), "image_tokens": int(valid.sum()),
            "corrupt": corrupt, "messages": messages}


def _worker() -> Tuple[int, Optional[int]]:
    info = torch.utils.data.get_worker_info()
    return (0, None) if info is None else (info.id, info.num_workers)


class TrainStream(torch.utils.data.IterableDataset):
    """One epoch of one rank's batches; in a DataLoader worker, that worker's share of them."""

    def __init__(self, urls: Sequence[str], plan: Schedule, num_batches: int, epoch: int, rank: int,
                 world_size: int, workers: int, shuffle_buffer: int, tokenizer: Callable):
        super().__init__()
        self.urls, self.plan, self.num_batches, self.epoch = list(urls), plan, num_batches, epoch
        self.rank, self.world_size, self.workers = rank, world_size, max(1, workers)
        self.shuffle_buffer, self.tokenizer = shuffle_buffer, tokenizer

    def __iter__(self):
        worker, seen = _worker()
        if seen is not None and seen != self.workers:
            raise RuntimeError(f"TrainStream built for {self.workers} workers runs in a DataLoader with {seen}")
        try:
            yield from self._batches(worker)
        except UsageError as exc:
            yield None, {"error": str(exc)}

    def samples(self, worker: int, report: Corruption) -> Iterator[RawSample]:
        """This (rank, worker)'s endless, shuffled sample stream for the epoch."""
        seed = self.plan.seed
        slot, num_slots = self.rank * self.workers + worker, self.world_size * self.workers
        shards = shard_order(self.urls, seed, self.epoch, slot, num_slots)
        raw = sample_stream(shards, report, len(set(self.urls)))
        rng = random.Random(derive_seed("samples", seed, self.epoch, self.rank, worker))
        return shuffled(raw, self.shuffle_buffer, rng)

    def _batches(self, worker: int):
        specs = self.plan.epoch(self.epoch, self.num_batches)
        report = Corruption()
        samples = self.samples(worker, report)
        flatten = not self.plan.multi_patch
        for index in range(worker, self.num_batches, self.workers):
            spec: BatchSpec = specs[index]
            items, captions = decode_samples(samples, spec.batch_size, spec.seq_len, spec.patch_size,
                                             flatten, report, "--train-data")
            batch = make_batch(items, captions, spec.seq_len, self.tokenizer)
            yield batch, batch_meta(index, batch, report)


class ValStream(torch.utils.data.IterableDataset):
    """Held-out batches in a fixed order: shards in the given order (worker w reads shards w, w+W, ...)."""

    def __init__(self, urls: Sequence[str], seq_len: int, batch_size: int, patch_size: int, tokenizer: Callable):
        super().__init__()
        self.urls, self.seq_len, self.batch_size = list(urls), seq_len, batch_size
        self.patch_size, self.tokenizer = patch_size, tokenizer

    def __iter__(self):
        worker, workers = _worker()
        report = Corruption()
        samples = (s for url in self.urls[worker::workers or 1] for s in shard_samples(url, report))
        index = worker
        try:
            while True:
                items, captions = decode_samples(samples, self.batch_size, self.seq_len, self.patch_size,
                                                 True, report, "--val-data")
                if not items:
                    break
                batch = make_batch(items, captions, self.seq_len, self.tokenizer)
                yield batch, batch_meta(index, batch, report)
                index += workers or 1
        except UsageError as exc:
            yield None, {"error": str(exc)}
        if report.count:  # corrupt samples after the last batch still reach the main process's stats
            yield None, {"corrupt": report.count, "messages": report.messages}
