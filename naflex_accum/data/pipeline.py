"""The worker side: one rank's batches of an epoch segment, each worker building its part of every batch.

Invariant: every worker yields exactly one ``(part, meta)`` per batch from ``start_batch`` on, in order: the
rows whose positions fall in its slots, each the sample ``slots.EpochOrder`` puts there or a stand-in
(``fill``), so batches never depend on the workers; batches before ``start_batch`` cost a header read each. A
``UsageError`` comes back as ``(None, {"error": message})``. docs/data.md, "How batches reach the training process".
"""
import math
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from ..errors import UsageError
from .decode import decode_for_seq
from .fill import MAX_CONSECUTIVE_FAILURES, BatchFill, Readers
from .handover import WorkerSlots, fresh_shared, new_flags, pack
from .order import Segment, batch_positions, cursors, slot_worker
from .patches import patch_grid, patchify_images, patchify_into
from .samples import Corruption, RawSample, shard_samples
from .schedule import BatchSpec, Schedule
from .slots import DataIndex, EpochOrder
from .text import BatchTokenizer


def _take(samples: Iterator[RawSample], count: int, use: Callable, report: Corruption, flag: str) -> List:
    """``use(sample)`` for the next ``count`` samples it succeeds on (fewer only if ``samples`` ends); one it raises
    on is skipped and reported, ``MAX_CONSECUTIVE_FAILURES`` in a row is a UsageError."""
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
                   report: Corruption, flag: str, decode: str = "scaled"
                   ) -> Tuple[List[torch.Tensor], List[str], List[str]]:
    """Up to ``count`` uint8 images at their NaFlex size (``decode``), their captions and their sample keys
    (``url#key``); failures are skipped and reported (held-out data: every usable sample once, in order)."""
    def use(raw):
        return decode_for_seq(raw.data, seq_len, patch_size, decode), raw.caption, f"{raw.url}#{raw.key}"
    taken = _take(samples, count, use, report, flag)
    return [t[0] for t in taken], [t[1] for t in taken], [t[2] for t in taken]


def make_batch(images: List[torch.Tensor], captions: List[str], seq_len: int, patch_size: int, flatten: bool,
               tokenize: Callable, alloc: Optional[Callable[[int], torch.Tensor]] = None) -> Dict:
    """A held-out batch as the loader hands it over: uint8 patches (the task's ``prepare_batch`` normalises them on
    the device); ``alloc`` supplies their memory, else a new tensor. Training parts are built by ``_part``."""
    return {"image": patchify_images(images, seq_len, patch_size, flatten, alloc=alloc), "text": tokenize(captions)}


def batch_meta(index: int, batch: Dict, report: Corruption) -> Dict:
    corrupt, messages = report.drain()
    valid = batch["image"]["patch_valid"]
    return {"index": index, "samples": int(valid.shape[0]), "image_tokens": int(valid.sum()),
            "corrupt": corrupt, "messages": messages}


def _worker() -> Tuple[int, Optional[int]]:
    info = torch.utils.data.get_worker_info()
    return (0, None) if info is None else (info.id, info.num_workers)


def _segment(position: torch.Tensor) -> Tuple[Segment, int]:
    """The segment and start batch a ``TrainLoader`` wrote into ``position`` (see ``TrainLoader.position``)."""
    epoch, start, base, num_batches, world, slots, first = (int(x) for x in position[:7])
    return Segment(epoch, num_batches, world, slots, base, first), start


class TrainStream(torch.utils.data.IterableDataset):
    """One rank's batches of one epoch segment; in a DataLoader worker, its slots' rows of each. ``position``: the
    shared tensor ``set_epoch`` writes; with ``recycle`` patches go into ``handover`` slots (a ``Receiver``)."""

    def __init__(self, index: DataIndex, plan: Schedule, position: torch.Tensor, rank: int, workers: int,
                 window: int, tokenizer: Callable, resampled: bool = False, recycle: bool = False,
                 decode: str = "scaled", ring=None):
        super().__init__()
        self.decode, self.ring = decode, ring
        self.index, self.plan, self.position = index, plan, position
        self.rank, self.workers = rank, max(1, workers)
        self.window, self.tokenize = window, BatchTokenizer(tokenizer)
        self.resampled = resampled
        self.flags, self.recycle = new_flags(self.workers), recycle
        self._slots = None  # this worker's WorkerSlots, made in the worker, kept while it lives

    def __iter__(self):
        worker, seen = _worker()
        if seen is not None and seen != self.workers:
            raise RuntimeError(f"TrainStream built for {self.workers} workers runs in a DataLoader with {seen}")
        segment, start = _segment(self.position)
        if self.recycle:
            if self._slots is None:
                self._slots = WorkerSlots(self.flags, worker)
            alloc, send = self._slots.alloc, self._slots.pack
        elif seen is not None:
            alloc, send = fresh_shared, pack
        else:
            alloc, send = None, (lambda item: item)
        try:
            for item in self._batches(worker, segment, start, alloc):
                yield send(item)
        except UsageError as exc:
            yield None, {"error": str(exc)}

    def epoch_order(self, epoch: int, slots: int) -> EpochOrder:
        # passes kept apart by one optimizer step's window: the contrastive batch the loss sees
        return EpochOrder(self.index, self.plan.seed, epoch, slots, self.window, self.plan.window_rows, self.resampled)

    def _batches(self, worker: int, segment: Optional[Segment] = None, start: Optional[int] = None,
                 alloc: Optional[Callable[[int], torch.Tensor]] = None):
        if segment is None:
            segment, start = _segment(self.position)
        specs = self.plan.epoch(segment.epoch, segment.num_batches, segment.base)
        firsts = cursors([spec.batch_size for spec in specs])
        report, failures = Corruption(), [0]
        order = self.epoch_order(segment.epoch, segment.slots)
        readers = Readers(order)
        flatten = not self.plan.multi_patch
        generation = int(self.position[7]) if len(self.position) > 7 else 0
        world, k = segment.world_size, self.plan.accum_freq
        fill, counted = None, (0, 0)
        try:
            for index in range(start or 0, len(specs)):
                spec: BatchSpec = specs[index]
                if fill is None or index % k == 0:  # a window's batches share one fill (segments start at one)
                    first, last = index - index % k, min(len(specs), index - index % k + k) - 1
                    lo = segment.base + world * firsts[first]
                    hi = segment.base + world * (firsts[last] + specs[last].batch_size)
                    fill, counted = BatchFill(order, readers, lo, hi, report, "--train-data", failures), (0, 0)
                positions = batch_positions(segment, self.rank, firsts[index], spec.batch_size)
                located = [order.locate(g) for g in positions]
                order_rows = [row for row, (slot, _, _) in enumerate(located)
                              if slot_worker(slot, world, self.workers) == worker]
                if not order_rows:
                    _, messages = report.drain()
                    yield None, {"index": index, "rows": [], "corrupt": 0, "messages": messages,
                                 "worker": worker, "standins": 0}
                    continue
                into, buffer = self._ring_rows(generation, index, spec, order_rows)
                batch, captions, keys, grid = _part(fill, located, order_rows, spec, self.decode, into,
                                                    None if into else alloc)
                if not flatten and batch["patches"] is not None:
                    p = spec.patch_size
                    batch["patches"] = batch["patches"].view(len(order_rows), spec.seq_len, p, p, 3)
                batch = {"image": batch, "text": self.tokenize(captions)}
                unusable, standins = fill.unusable - counted[0], fill.standins - counted[1]
                counted = (fill.unusable, fill.standins)
                yield batch, dict(batch_meta(index, batch, report), rows=order_rows, keys=keys, worker=worker,
                                  ring=buffer, grid=grid, seq_len=spec.seq_len, corrupt=unusable,
                                  standins=standins)
        finally:
            readers.close()

    def _ring_rows(self, generation: int, index: int, spec: BatchSpec, rows: List[int]):
        """``((patches, rows), buffer)`` when batch ``index`` was assigned a ring buffer, else (None, None)."""
        buffer = None if self.ring is None else self.ring.lookup(generation, index)
        shape = (spec.batch_size, spec.seq_len, spec.patch_size ** 2 * 3)
        if buffer is None or spec.batch_size * shape[1] * shape[2] > self.ring.capacity:
            return None, None
        memory = self.ring.memory[buffer][:spec.batch_size * shape[1] * shape[2]].view(shape)
        return (memory, rows), buffer


def _part(fill: BatchFill, located: List[Tuple[int, int, int]], order: List[int], spec: BatchSpec, decode: str,
          into=None, alloc: Optional[Callable[[int], torch.Tensor]] = None):
    """One worker's part of a batch, its rows ``order``: ``(image, captions, keys, grid)`` in row order. Each image
    goes into its row as it is decoded: into the ring buffer ``into=(patches, rows)`` (its dict's patches then
    None), else ``alloc``'s memory or a new tensor; a row whose sample cannot serve takes a stand-in (``fill``)."""
    seq_len, p = spec.seq_len, spec.patch_size
    shape = (len(order), seq_len, p * p * 3)
    if into is None:
        patches = torch.empty(shape, dtype=torch.uint8) if alloc is None else alloc(math.prod(shape)).view(shape)
        target = {row: i for i, row in enumerate(order)}
    else:
        patches, target = into[0], {row: row for row in order}
    flat, taken = patches.numpy(), []
    for row in order:
        taken.append(fill.take(*located[row], _row_writer(flat[target[row]], seq_len, p, decode)))
    grid, captions, keys = zip(*taken)
    coord, valid = patch_grid(*zip(*grid), seq_len)
    return ({"patches": None if into is not None else patches, "patch_coord": coord, "patch_valid": valid},
            list(captions), list(keys), list(grid))


def _row_writer(row, seq_len: int, patch_size: int, decode: str) -> Callable:
    """``use`` for ``fill``: a sample decoded straight into ``row`` (a numpy uint8 batch row);
    ``(grid, caption, key)``, grid being the image's ``(patch count, grid width)``."""
    def use(raw):
        img = decode_for_seq(raw.data, seq_len, patch_size, decode)
        return patchify_into(row, img, patch_size), raw.caption, f"{raw.url}#{raw.key}"
    return use


class ValStream(torch.utils.data.IterableDataset):
    """Held-out batches in a fixed order: shards in the given order (worker w reads shards w, w+W, ...)."""

    def __init__(self, urls: Sequence[str], seq_len: int, batch_size: int, patch_size: int, tokenizer: Callable,
                 decode: str = "scaled", flatten: bool = True):
        super().__init__()
        self.decode, self.flatten = decode, flatten
        self.urls, self.seq_len, self.batch_size = list(urls), seq_len, batch_size
        self.patch_size, self.tokenize = patch_size, BatchTokenizer(tokenizer)

    def __iter__(self):
        worker, workers = _worker()
        report = Corruption()
        samples = (s for url in self.urls[worker::workers or 1] for s in shard_samples(url, report))
        index = worker
        try:
            while True:
                images, captions, _ = decode_samples(samples, self.batch_size, self.seq_len, self.patch_size,
                                                  report, "--val-data", self.decode)
                if not images:
                    break
                batch = make_batch(images, captions, self.seq_len, self.patch_size, self.flatten, self.tokenize,
                                   fresh_shared if workers else None)
                item = batch, batch_meta(index, batch, report)
                yield pack(item) if workers else item
                index += workers or 1
        except UsageError as exc:
            yield None, {"error": str(exc)}
        if report.count:  # corrupt samples after the last batch still reach the main process's stats
            yield None, {"corrupt": report.count, "messages": report.messages}
