"""The worker side: raw samples -> parts of NaFlex batches, one stream per slot (``order``).

Invariant: every worker of a rank yields exactly one part of every batch of the
segment from ``start_batch`` on, in order (so torch's DataLoader round-robin
delivers a batch's parts one after another): the rows of the batch whose global
positions fall in the slots it owns, each filled from that slot's sample stream,
whose order is a pure function of ``(seed, epoch, slot)`` and never of the batch
sizes, the world size or the workers: a sample that fails to decode is skipped
(and reported) and the row takes the slot's next one. What the batches before
``start_batch`` (and the segments before this one) took is skipped, not built:
those samples are read and pass the shuffle, and each image gets the header
check that decoding starts with (``images.inspect``), so a skip counts the same
samples as undecodable as a decode would whenever the check is what fails (a
cut-short file, a bad header, too many pixels), and nothing is decoded, resized,
tokenized or collated. Every yield is ``(part, meta)``: the part has exactly the
keys the model takes (None for a worker with no rows in that batch), and
``meta`` carries the batch index, the part's rows and its counts (samples, image
tokens, corrupt samples and their messages) back to the main process. A
``UsageError`` in a worker is sent back as ``(None, {"error": message})`` so the
main process can raise it as one clean line. How a worker's parts reach the
main process (recycled shared memory) is ``handover``'s.
"""
import math
import random
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from ..errors import UsageError
from ..naflex import patch_grid, patchify_images, patchify_into
from .decode import decode_for_seq
from .handover import WorkerSlots, fresh_shared, new_flags, pack
from .images import inspect
from .order import Segment, batch_positions, cursors, skipped_before, worker_slots
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
                   report: Corruption, flag: str, decode: str = "scaled"
                   ) -> Tuple[List[torch.Tensor], List[str], List[str]]:
    """Up to ``count`` uint8 images at their NaFlex size (``decode``), their captions and their sample keys
    (``url#key``); failures are skipped and reported."""
    def use(raw):
        return decode_for_seq(raw.data, seq_len, patch_size, decode), raw.caption, f"{raw.url}#{raw.key}"
    taken = _take(samples, count, use, report, flag)
    return [t[0] for t in taken], [t[1] for t in taken], [t[2] for t in taken]


def skip_samples(samples: Iterator[RawSample], count: int, report: Corruption, flag: str) -> None:
    """Consume what ``decode_samples`` would for ``count`` samples, checking headers only (see module docstring)."""
    _take(samples, count, lambda raw: inspect(raw.data), report, flag)


def make_batch(images: List[torch.Tensor], captions: List[str], seq_len: int, patch_size: int, flatten: bool,
               tokenize: Callable, alloc: Optional[Callable[[int], torch.Tensor]] = None) -> Dict:
    """A held-out batch as the loader hands it over: uint8 patches (``naflex.normalize_patches`` makes the
    model's floats, on the training device: the task's ``prepare_batch``); ``alloc`` supplies the patches'
    memory (shared memory, ``handover``), else a new tensor. Training parts are built by ``_part``."""
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
    """One rank's batches of one epoch segment; in a DataLoader worker, that worker's part of each of them.

    ``position`` is the int64 tensor ``TrainLoader`` writes its segment and start
    batch into, read at each ``iter``: in shared memory it lets persistent workers
    follow ``set_epoch``. Each worker reads the slots ``order.worker_slots`` gives it
    and yields, for every batch from the start batch on, its part: the rows of the
    batch (positions in it) whose samples come from its slots, collated, with
    ``meta["rows"]`` saying which (``TrainLoader`` puts the parts together). With
    ``recycle`` (what ``TrainLoader`` asks for unless it pins) patches go into recycled
    shared-memory slots (``handover``), in a worker or in this process alike, and what
    it yields must go through a ``handover.Receiver`` over ``flags``; without it workers
    write each part into fresh shared memory, and in this process parts are plain.
    """

    def __init__(self, urls: Sequence[str], plan: Schedule, position: torch.Tensor, rank: int, workers: int,
                 shuffle_buffer: int, tokenizer: Callable, resampled: bool = False,
                 weights: Optional[Sequence[float]] = None, recycle: bool = False, decode: str = "scaled",
                 ring=None):
        super().__init__()
        self.decode, self.ring = decode, ring
        self.urls, self.plan, self.position = list(urls), plan, position
        self.rank, self.workers = rank, max(1, workers)
        self.shuffle_buffer, self.tokenize = shuffle_buffer, BatchTokenizer(tokenizer)
        self.resampled, self.weights = resampled, weights
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

    def slot_samples(self, slot: int, slots: int, epoch: int, report: Corruption) -> Iterator[RawSample]:
        """Slot ``slot`` of ``slots``: its endless, shuffled sample stream for the epoch (``order``)."""
        seed = self.plan.seed
        if self.resampled:
            shards = shard_sampler(self.urls, self.weights, seed, epoch, slot)
            distinct = len({u for u, w in zip(self.urls, self.weights or [1] * len(self.urls)) if w > 0})
        else:
            shards, distinct = shard_order(self.urls, seed, epoch, slot, slots), len(set(self.urls))
        raw = sample_stream(shards, report, distinct)
        return shuffled(raw, self.shuffle_buffer, random.Random(derive_seed("samples", seed, epoch, slot)))

    def _batches(self, worker: int, segment: Optional[Segment] = None, start: Optional[int] = None,
                 alloc: Optional[Callable[[int], torch.Tensor]] = None):
        if segment is None:
            segment, start = _segment(self.position)
        specs = self.plan.epoch(segment.epoch, segment.num_batches, segment.base)
        firsts = cursors([spec.batch_size for spec in specs])
        report = Corruption()
        owned = worker_slots(segment, self.rank, worker, self.workers)
        streams = {slot: self.slot_samples(slot, segment.slots, segment.epoch, report) for slot in owned}
        start = start or 0
        if start < len(specs):  # what the batches before ``start`` took is skipped, header checks only
            resume_at = segment.base + segment.world_size * firsts[start]
            for slot, samples in streams.items():
                skip_samples(samples, skipped_before(resume_at, slot, segment.slots), report, "--train-data")
        flatten = not self.plan.multi_patch
        generation = int(self.position[7]) if len(self.position) > 7 else 0
        for index in range(start, len(specs)):
            spec: BatchSpec = specs[index]
            rows = {slot: [] for slot in owned}
            for row, position in enumerate(batch_positions(segment, self.rank, firsts[index], spec.batch_size)):
                if position % segment.slots in rows:
                    rows[position % segment.slots].append(row)
            order = sorted(row for slot_rows in rows.values() for row in slot_rows)
            if not order:
                corrupt, messages = report.drain()
                yield None, {"index": index, "rows": [], "corrupt": corrupt, "messages": messages, "worker": worker}
                continue
            into, buffer = self._ring_rows(generation, index, spec, order)
            batch, captions, keys, grid = _part(streams, rows, order, spec, report, self.decode, into,
                                                None if into else alloc)
            if not flatten and batch["patches"] is not None:
                p = spec.patch_size
                batch["patches"] = batch["patches"].view(len(order), spec.seq_len, p, p, 3)
            batch = {"image": batch, "text": self.tokenize(captions)}
            yield batch, dict(batch_meta(index, batch, report), rows=order, keys=keys, worker=worker, ring=buffer,
                              grid=grid, seq_len=spec.seq_len)

    def _ring_rows(self, generation: int, index: int, spec: BatchSpec, rows: List[int]):
        """``((patches, rows), buffer)`` when the main process assigned batch ``index`` a ring buffer, else (None, None)."""
        buffer = None if self.ring is None else self.ring.lookup(generation, index)
        shape = (spec.batch_size, spec.seq_len, spec.patch_size ** 2 * 3)
        if buffer is None or spec.batch_size * shape[1] * shape[2] > self.ring.capacity:
            return None, None
        memory = self.ring.memory[buffer][:spec.batch_size * shape[1] * shape[2]].view(shape)
        return (memory, rows), buffer


def _part(streams: Dict, rows: Dict[int, List[int]], order: List[int], spec: BatchSpec, report: Corruption,
          decode: str, into=None, alloc: Optional[Callable[[int], torch.Tensor]] = None):
    """One worker's part of a batch, its rows ``order`` (ascending): ``(image, captions, keys, grid)``, each in
    row order. Each image goes into its row the moment it is decoded (``naflex.patchify_into``), while it is
    still in the cache: into the ring buffer ``into=(patches, rows)`` (the image dict's patches are then
    None), else into ``alloc``'s memory or a new tensor; a sample that fails is skipped and the row takes the
    slot's next one, as ``decode_samples`` does."""
    seq_len, p = spec.seq_len, spec.patch_size
    shape = (len(order), seq_len, p * p * 3)
    if into is None:
        patches = torch.empty(shape, dtype=torch.uint8) if alloc is None else alloc(math.prod(shape)).view(shape)
        target = {row: i for i, row in enumerate(order)}
    else:
        patches, target = into[0], {row: row for row in order}
    flat, taken = patches.numpy(), {}
    for slot, slot_rows in rows.items():
        if slot_rows:
            use = _row_writer([flat[target[row]] for row in slot_rows], seq_len, p, decode)
            taken.update(zip(slot_rows, _take(streams[slot], len(slot_rows), use, report, "--train-data")))
    if len(taken) != len(order):  # only a stream that ended could: train streams do not end
        raise RuntimeError(f"a loader worker filled {len(taken)} of its {len(order)} rows of a batch")
    grid, captions, keys = zip(*(taken[row] for row in order))
    coord, valid = patch_grid(*zip(*grid), seq_len)
    return ({"patches": None if into is not None else patches, "patch_coord": coord, "patch_valid": valid},
            list(captions), list(keys), list(grid))


def _row_writer(rows: List, seq_len: int, patch_size: int, decode: str) -> Callable:
    """``use`` for ``_take``: a sample decoded straight into the next of ``rows`` (numpy uint8 batch rows);
    ``(grid, caption, key)``, grid being the image's ``(patch count, grid width)``."""
    done = [0]

    def use(raw):
        img = decode_for_seq(raw.data, seq_len, patch_size, decode)
        grid = patchify_into(rows[done[0]], img, patch_size)
        done[0] += 1  # only now: a sample that fails leaves its row to the next one
        return grid, raw.caption, f"{raw.url}#{raw.key}"
    return use


class ValStream(torch.utils.data.IterableDataset):
    """Held-out batches in a fixed order: shards in the given order (worker w reads shards w, w+W, ...)."""

    def __init__(self, urls: Sequence[str], seq_len: int, batch_size: int, patch_size: int, tokenizer: Callable,
                 decode: str = "scaled"):
        super().__init__()
        self.decode = decode
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
                batch = make_batch(images, captions, self.seq_len, self.patch_size, True, self.tokenize,
                                   fresh_shared if workers else None)
                item = batch, batch_meta(index, batch, report)
                yield pack(item) if workers else item
                index += workers or 1
        except UsageError as exc:
            yield None, {"error": str(exc)}
        if report.count:  # corrupt samples after the last batch still reach the main process's stats
            yield None, {"corrupt": report.count, "messages": report.messages}
