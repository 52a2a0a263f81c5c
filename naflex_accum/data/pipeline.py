"""The worker side: raw samples -> NaFlex batches, one stream per (rank, worker).

Invariant: worker w of W builds exactly the batches i of the epoch's schedule
with ``i % W == w`` and ``i >= start_batch``, in order (torch's DataLoader
round-robin), each filled to its scheduled size from the worker's sample stream,
whose order is a pure function of ``(seed, epoch, rank, worker)`` and never of
the batch sizes: a sample that fails to decode is skipped (and reported) and the
batch takes the next one. The batches before ``start_batch`` are skipped, not
built: their samples are read and pass the shuffle, and each image gets the
header check that decoding starts with (``images.inspect``), so a skip counts
the same samples as undecodable as a decode would whenever the check is what
fails (a cut-short file, a bad header, too many pixels), and nothing is decoded,
resized, tokenized or collated. Every yield is ``(batch, meta)``: the batch has
exactly the keys the model takes, and ``meta`` carries the index and this
batch's counts (samples, image tokens, corrupt samples and their messages) back
to the main process. A ``UsageError`` in a worker is sent back as
``(None, {"error": message})`` so the main process can raise it as one clean line.
How a worker's batches reach the main process (recycled shared memory) is ``handover``'s.
"""
import random
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from ..errors import UsageError
from ..naflex import collate_images, resize_for_seq
from .handover import WorkerSlots, fresh_shared, new_flags, pack
from .images import decode_rgb, inspect
from .samples import Corruption, RawSample, sample_stream, shard_samples, shuffled
from .schedule import BatchSpec, Schedule, derive_seed
from .shards import shard_order, shard_sampler
from .text import BatchTokenizer

# Consecutive undecodable images before giving up: only a data set with no decodable image gets there.
MAX_CONSECUTIVE_FAILURES = 1000


def _take(samples: Iterator[RawSample], count: int, use: Callable, report: Corruption, flag: str) -> List:
    """``use(sample)`` for the next ``count`` samples it succeeds on (fewer only if ``samples`` ends).

    A sample ``use`` raises on is skipped and reported; ``MAX_CONSECUTIVE_FAILURES`` in a row is a UsageError.
    """
    out, failures = [], 0
    while len(out) < count:
        raw = next(samples, None)
        if raw is None:
            break
        try:
            out.append(use(raw))
        except Exception as exc:  # truncated data, bad PNG chunks, decompression bombs: all "skip this one"
            report.add(raw.url, raw.key, f"undecodable image ({type(exc).__name__}: {exc})")
            failures += 1
            if failures >= MAX_CONSECUTIVE_FAILURES:
                raise UsageError(f"{flag}: {failures} images in a row failed to decode; last: {report.last}")
            continue
        failures = 0
    return out


def decode_samples(samples: Iterator[RawSample], count: int, seq_len: int, patch_size: int,
                   report: Corruption, flag: str) -> Tuple[List[torch.Tensor], List[str]]:
    """Up to ``count`` decoded, resized uint8 images and their captions; failures are skipped and reported."""
    def use(raw):
        return resize_for_seq(decode_rgb(raw.data), seq_len, patch_size), raw.caption
    pairs = _take(samples, count, use, report, flag)
    return [image for image, _ in pairs], [caption for _, caption in pairs]


def skip_samples(samples: Iterator[RawSample], count: int, report: Corruption, flag: str) -> None:
    """Consume what ``decode_samples`` would for ``count`` samples, checking headers only (see module docstring)."""
    _take(samples, count, lambda raw: inspect(raw.data), report, flag)


def make_batch(images: List[torch.Tensor], captions: List[str], seq_len: int, patch_size: int, flatten: bool,
               tokenize: Callable, alloc: Optional[Callable[[int], torch.Tensor]] = None) -> Dict:
    """The model's batch; ``alloc`` supplies the patches' memory (shared memory, ``handover``), else a new tensor."""
    return {"image": collate_images(images, seq_len, patch_size, flatten, alloc=alloc), "text": tokenize(captions)}


def batch_meta(index: int, batch: Dict, report: Corruption) -> Dict:
    corrupt, messages = report.drain()
    valid = batch["image"]["patch_valid"]
    return {"index": index, "samples": int(valid.shape[0]), "image_tokens": int(valid.sum()),
            "corrupt": corrupt, "messages": messages}


def _worker() -> Tuple[int, Optional[int]]:
    info = torch.utils.data.get_worker_info()
    return (0, None) if info is None else (info.id, info.num_workers)


class TrainStream(torch.utils.data.IterableDataset):
    """One epoch of one rank's batches; in a DataLoader worker, that worker's share of them.

    ``position`` is an int64 tensor ``[epoch, start_batch]``, read at each ``iter``: in
    shared memory it lets persistent workers follow ``TrainLoader.set_epoch``. With
    ``recycle`` (what ``TrainLoader`` asks for unless it pins) patches go into recycled
    shared-memory slots (``handover``), in a worker or in this process alike, and what
    it yields must go through a ``handover.Receiver`` over ``flags``; without it workers
    write each batch into fresh shared memory, and in this process batches are plain.
    """

    def __init__(self, urls: Sequence[str], plan: Schedule, num_batches: int, position: torch.Tensor, rank: int,
                 world_size: int, workers: int, shuffle_buffer: int, tokenizer: Callable,
                 resampled: bool = False, weights: Optional[Sequence[float]] = None, recycle: bool = False):
        super().__init__()
        self.urls, self.plan, self.num_batches, self.position = list(urls), plan, num_batches, position
        self.rank, self.world_size, self.workers = rank, world_size, max(1, workers)
        self.shuffle_buffer, self.tokenize = shuffle_buffer, BatchTokenizer(tokenizer)
        self.resampled, self.weights = resampled, weights
        self.flags, self.recycle = new_flags(self.workers), recycle
        self._slots = None  # this worker's WorkerSlots, made in the worker, kept while it lives

    @property
    def epoch(self) -> int:
        return int(self.position[0])

    def __iter__(self):
        worker, seen = _worker()
        if seen is not None and seen != self.workers:
            raise RuntimeError(f"TrainStream built for {self.workers} workers runs in a DataLoader with {seen}")
        epoch, start = (int(x) for x in self.position)
        if self.recycle:
            if self._slots is None:
                self._slots = WorkerSlots(self.flags, worker)
            alloc, send = self._slots.alloc, self._slots.pack
        elif seen is not None:
            alloc, send = fresh_shared, pack
        else:
            alloc, send = None, (lambda item: item)
        try:
            for item in self._batches(worker, epoch, start, alloc):
                yield send(item)
        except UsageError as exc:
            yield None, {"error": str(exc)}

    def samples(self, worker: int, report: Corruption, epoch: Optional[int] = None) -> Iterator[RawSample]:
        """This (rank, worker)'s endless, shuffled sample stream for the epoch."""
        seed, epoch = self.plan.seed, self.epoch if epoch is None else epoch
        slot, num_slots = self.rank * self.workers + worker, self.world_size * self.workers
        if self.resampled:
            shards = shard_sampler(self.urls, self.weights, seed, epoch, slot)
            distinct = len({u for u, w in zip(self.urls, self.weights or [1] * len(self.urls)) if w > 0})
        else:
            shards, distinct = shard_order(self.urls, seed, epoch, slot, num_slots), len(set(self.urls))
        raw = sample_stream(shards, report, distinct)
        rng = random.Random(derive_seed("samples", seed, epoch, self.rank, worker))
        return shuffled(raw, self.shuffle_buffer, rng)

    def _batches(self, worker: int, epoch: Optional[int] = None, start: int = 0,
                 alloc: Optional[Callable[[int], torch.Tensor]] = None):
        epoch = self.epoch if epoch is None else epoch
        specs = self.plan.epoch(epoch, self.num_batches)
        report = Corruption()
        samples = self.samples(worker, report, epoch)
        flatten = not self.plan.multi_patch
        for index in range(worker, self.num_batches, self.workers):
            spec: BatchSpec = specs[index]
            if index < start:
                skip_samples(samples, spec.batch_size, report, "--train-data")
                continue
            images, captions = decode_samples(samples, spec.batch_size, spec.seq_len, spec.patch_size,
                                              report, "--train-data")
            batch = make_batch(images, captions, spec.seq_len, spec.patch_size, flatten, self.tokenize, alloc)
            yield batch, batch_meta(index, batch, report)


class ValStream(torch.utils.data.IterableDataset):
    """Held-out batches in a fixed order: shards in the given order (worker w reads shards w, w+W, ...)."""

    def __init__(self, urls: Sequence[str], seq_len: int, batch_size: int, patch_size: int, tokenizer: Callable):
        super().__init__()
        self.urls, self.seq_len, self.batch_size = list(urls), seq_len, batch_size
        self.patch_size, self.tokenize = patch_size, BatchTokenizer(tokenizer)

    def __iter__(self):
        worker, workers = _worker()
        report = Corruption()
        samples = (s for url in self.urls[worker::workers or 1] for s in shard_samples(url, report))
        index = worker
        try:
            while True:
                images, captions = decode_samples(samples, self.batch_size, self.seq_len, self.patch_size,
                                                  report, "--val-data")
                if not images:
                    break
                batch = make_batch(images, captions, self.seq_len, self.patch_size, True, self.tokenize,
                                   fresh_shared if workers else None)
                item = batch, batch_meta(index, batch, report)
                yield pack(item) if workers else item
                index += workers or 1
        except UsageError as exc:
            yield None, {"error": str(exc)}
        if report.count:  # corrupt samples after the last batch still reach the main process's stats
            yield None, {"corrupt": report.count, "messages": report.messages}
