"""The main-process side: ``make_train_loader`` / ``make_val_loader`` and the loaders they return.

Invariant: a train loader yields exactly ``num_batches - start_batch`` batches an epoch, in schedule order,
the same count on every rank, each ``{"image", "text"}`` put together row for row (``assemble``), so the same
whatever ``--workers``; ``stats`` counts what arrived, corrupt samples included. A worker that dies, raises or
stalls past ``DataConfig.timeout`` is one line (``workers.failure``, ``alarm.LoaderTimeout``). docs/data.md.
"""
import logging
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch

from ..errors import UsageError, check_int
from .alarm import bounded
from .assemble import Pool, assemble
from .decode import check_mode
from .delivery import EpochCounter, iterate, torch_loader
from .handover import Receiver
from .index import listed_total, same_file, shard_sizes
from .order import Segment, check_slots, default_slots
from .pipeline import TrainStream, ValStream
from .ring import Ring
from .samples import IMAGE_EXTS, Corruption, shard_samples
from .schedule import BatchSpec, DataConfig, Schedule
from .shards import expand_sources, expand_urls, shard_weights, upsampling_factors
from .slots import DataIndex
from .workers import of as worker_processes, stop as stop_workers

log = logging.getLogger(__name__)
RING_LOOKAHEAD = 4  # batches past the one delivered that get a ring buffer: more than workers run ahead


class TrainLoader:
    """One rank's training batches; ``set_epoch`` picks the epoch (and the first batch), iterating yields its batches;
    ``iter_meta()`` adds each batch's CPU-side ``meta``. Workers persist across epochs."""

    def __init__(self, cfg: DataConfig, tokenizer: Callable, pin_memory: bool = False):
        self.cfg, self.tokenizer, self.pin_memory = cfg, tokenizer, pin_memory
        self._plan = check_data_config(cfg)
        self._pool = Pool()  # memory for batches put together from several workers' parts
        num_samples, num_tokens = cfg.num_samples, cfg.num_image_tokens
        self.slots = check_slots(default_slots(cfg.world_size, cfg.workers) if cfg.slots is None else cfg.slots,
                                 cfg.world_size)
        self.index = cfg.index if cfg.index is not None else data_index(cfg)
        if num_samples is None and num_tokens is None:
            num_samples = self.index.total  # the default epoch: the data set, once
        self._target = (num_samples, num_tokens)
        self.num_batches = self._plan.num_batches_within(num_samples, num_tokens)
        samples, tokens = self._plan.totals(self.num_batches)
        self.num_samples = samples * cfg.world_size        # global, every epoch alike (stratified schedule)
        self.num_token_slots = tokens * cfg.world_size     # global batch_size * seq_len summed over the epoch
        _check_sizes(self.index, self._plan, cfg, self.slots, self.num_samples, self._target)
        self.segment = Segment(0, self.num_batches, cfg.world_size, self.slots)
        # the segment and start batch (``_write_position``); in shared memory, so persistent workers see set_epoch
        # and, last, the iteration's generation (``ring``)
        self._position = torch.zeros(8, dtype=torch.int64).share_memory_()
        self._write_position(self.segment, 0)
        self._workers = None  # the persistent DataLoader (with workers) and its Receiver
        self._receiver = None
        self._ring = None  # with 2+ workers: the batches' shared buffers, made before the workers start
        self._generation = 0
        self.stats = EpochCounter("--train-data", 0).stats

    def describe(self) -> str:
        """One line: what an epoch holds, against the data set (passes, the last step's remainder)."""
        total, epoch = self.index.total, self.num_samples
        data = f"{total} samples in {len(self.index.urls)} shard(s)"
        if self.cfg.dataset_resampled:
            return f"--train-data: {data}; an epoch draws {epoch} samples with replacement (--dataset-resampled)"
        target = self._target[0]
        if target is None:
            return (f"--train-data: {data}; an epoch of {epoch} samples covers --naflex-num-train-image-tokens "
                    f"{self._target[1]} ({epoch / total:.3f} passes over the data set)")
        left = f"; the last step's remainder of {target - epoch} is not trained" if target > epoch else ""
        if epoch <= total:
            what = "each sample once" if epoch == total else "each sample at most once"
            return f"--train-data: {data}; an epoch of {epoch} samples holds {what}{left}"
        passes, rest = divmod(epoch, total)
        more = f", and {rest} samples of one more" if rest else ""
        return (f"--train-data: {data}; an epoch of {epoch} samples is {passes} whole pass(es) over the data set, "
                f"each its own order{more}{left}")

    def __len__(self) -> int:
        return self.num_batches

    @property
    def epoch(self) -> int:
        return self.segment.epoch

    @property
    def start_batch(self) -> int:
        return int(self._position[1])

    def _write_position(self, segment: Segment, start_batch: int) -> None:
        values = (segment.epoch, start_batch, segment.base, segment.num_batches, segment.world_size,
                  segment.slots, segment.first_step)
        self._position[:7].copy_(torch.tensor(values, dtype=torch.int64))

    def set_epoch(self, epoch: int, start_batch: int = 0, segment: Optional[Segment] = None):
        """Iterate epoch ``epoch`` (or ``segment``) from batch ``start_batch`` on, the ones before skipped undecoded."""
        check_int(epoch, "epoch", 0)
        check_int(start_batch, "start_batch", 0)
        if segment is None:
            segment = Segment(epoch, self.num_batches, self.cfg.world_size, self.slots)
        if segment.world_size != self.cfg.world_size:
            raise UsageError(f"a segment at world size {segment.world_size} cannot run at {self.cfg.world_size}")
        check_slots(segment.slots, self.cfg.world_size, "the checkpoint's --data-slots")
        if start_batch > segment.num_batches:
            raise UsageError(f"cannot start epoch {epoch} at batch {start_batch}: it has {segment.num_batches} "
                             f"batches")
        self.segment = segment
        self._write_position(segment, start_batch)

    def resized(self, saved: Segment, steps_done: int, samples: int, tokens: int) -> Segment:
        """The segment at this world size that goes on with ``saved``'s epoch after its step ``steps_done``, covering
        in whole steps what is left of the epoch's target after ``samples`` and ``tokens`` (global) consumed."""
        saved_steps = max(1, saved.num_batches // self.cfg.accum_freq)
        progress = saved.progress + (1.0 - saved.progress) * (steps_done - saved.first_step) / saved_steps
        num_samples, num_tokens = self._target
        left = num_samples - samples if num_samples is not None else num_tokens - tokens
        batches = 0 if left <= 0 else (self._plan.num_batches_within(left) if num_samples is not None
                                       else self._plan.num_batches_within(num_image_tokens=left))
        return Segment(saved.epoch, batches, self.cfg.world_size, saved.slots, samples, steps_done, progress, tokens)

    def schedule(self, epoch: Optional[int] = None) -> List[BatchSpec]:
        """The batches of the current segment; of epoch ``epoch`` whole when one is given."""
        if epoch is not None:
            return self._plan.epoch(epoch, self.num_batches)
        segment = self.segment
        return self._plan.epoch(segment.epoch, segment.num_batches, segment.base)

    def stream(self, position: Optional[torch.Tensor] = None, ring: Optional[Ring] = None) -> TrainStream:
        cfg = self.cfg
        position = self._position.clone() if position is None else position
        recycle = not (self.pin_memory and torch.cuda.is_available())
        return TrainStream(self.index, self._plan, position, cfg.rank, cfg.workers, cfg.sample_shuffle_size,
                           self.tokenizer, bool(cfg.dataset_resampled), recycle=recycle, decode=cfg.image_decode,
                           ring=ring)

    def _make_ring(self) -> Optional[Ring]:
        """Shared batch buffers for 2+ workers that hand over in recycled memory (a pinned loader copies anyway)."""
        if self.cfg.workers < 2 or (self.pin_memory and torch.cuda.is_available()):
            return None
        plan = self._plan
        capacity = max(b * s for b, s in zip(plan.batch_sizes, plan.seq_lens)) * max(plan.patch_sizes) ** 2 * 3
        return Ring(RING_LOOKAHEAD + self.cfg.accum_freq + 2, capacity, RING_LOOKAHEAD)

    def _source(self) -> Iterator:
        if self.cfg.workers == 0:
            stream = self.stream()
            return iterate(stream, self.pin_memory, Receiver(stream.flags), self.cfg.timeout)
        if self._workers is None:  # built once: its workers read the shared position at each epoch's start
            self._ring = self._ring or self._make_ring()
            stream = self.stream(self._position, self._ring)
            self._workers = torch_loader(stream, self.cfg.workers, self.pin_memory, persistent=True)
            self._receiver = Receiver(stream.flags)
        return iterate(self._workers, self.pin_memory, self._receiver, self.cfg.timeout)

    def close(self) -> None:
        """Stop the persistent workers (also done when the process exits); the next epoch starts new ones."""
        if self._workers is not None:
            stop_workers(worker_processes(self._workers))
        self._workers = self._receiver = None

    def __iter__(self) -> Iterator[Dict]:
        return (batch for batch, _ in self.iter_meta())

    def _target_for(self, ring: Optional[Ring], spec: BatchSpec, index: int):
        """(the patches tensor over batch ``index``'s ring buffer, the buffer), or (None, None) if it has none."""
        if ring is None:
            return None, None
        buffer = ring.assigned.get(index)
        p = spec.patch_size
        shape = (spec.batch_size, spec.seq_len) + ((p * p * 3,) if not self._plan.multi_patch else (p, p, 3))
        target = ring.take(index, spec.batch_size * spec.seq_len * p * p * 3, shape)
        return (target, buffer) if target is not None else (None, None)

    def iter_meta(self) -> Iterator[Tuple[Dict, Dict]]:
        counter = EpochCounter(f"--train-data (epoch {self.epoch}, rank {self.cfg.rank})", self.epoch)
        self.stats = counter.stats
        specs, parts_per_batch = self.schedule(), max(1, self.cfg.workers)
        self._generation += 1
        self._position[7] = self._generation
        source = self._source()
        ring = self._ring if self.cfg.workers >= 2 else None
        if ring is not None:
            ring.begin(self._generation, self.start_batch, len(specs), self.cfg.workers)
        pending, expected = {}, self.start_batch
        try:
            for part, meta in source:
                if part is None and "error" in meta:
                    raise UsageError(meta["error"])
                # The DataLoader delivers in order already; the buffer makes that a guarantee, not an assumption.
                pending.setdefault(meta["index"], []).append((part, meta))
                if ring is not None:
                    ring.received(meta.get("worker"))
                while len(pending.get(expected, ())) == parts_per_batch:
                    target, buffer = self._target_for(ring, specs[expected], expected)
                    batch, meta = assemble(pending.pop(expected), specs[expected].batch_size, self.pin_memory,
                                           self._pool, target, buffer)
                    counter.add(meta, batch)
                    expected += 1
                    yield batch, meta
        finally:
            del source
        if expected != len(specs) or pending:
            raise RuntimeError(f"train loader yielded {expected} of {len(specs)} batches "
                               f"({len(pending)} incomplete)")
        counter.close()


class ValLoader:
    """Every held-out sample once, in a fixed order, in batches of ``batch_size`` (the last may be smaller), their
    patches flattened or not (``flatten``: as the model's tower takes them, ``models.takes_flat_patches``)."""

    def __init__(self, val_data: str, tokenizer: Callable, seq_len: int = 144, batch_size: int = 64,
                 patch_size: int = 16, workers: int = 0, pin_memory: bool = False, decode: str = "scaled",
                 timeout: float = 0.0, flatten: bool = True):
        self.urls, self.timeout, self.flatten = expand_urls(val_data, "--val-data"), timeout, flatten
        self.decode = check_mode(decode)
        self.seq_len = check_int(seq_len, "val seq_len", 1, "an integer >= 1")
        self.batch_size = check_int(batch_size, "val batch_size", 1, "an integer >= 1")
        self.patch_size = check_int(patch_size, "val patch_size", 1, "an integer >= 1")
        self.workers = check_int(workers, "--workers", 0)
        self.tokenizer, self.pin_memory = tokenizer, pin_memory
        self._num_samples = None
        self.stats = EpochCounter("--val-data").stats

    @property
    def num_samples(self) -> int:
        """Samples with an image and a caption: from sizes.json if it lists every shard, else one read of the shards."""
        if self._num_samples is None:
            count = listed_total(self.urls)
            if count is None:
                count = sum(1 for url in self.urls for _ in shard_samples(url, Corruption()))
            self._num_samples = count
        return self._num_samples

    def __iter__(self) -> Iterator[Dict]:
        counter = EpochCounter("--val-data")
        self.stats = counter.stats
        stream = ValStream(self.urls, self.seq_len, self.batch_size, self.patch_size, self.tokenizer, self.decode,
                           self.flatten)
        count = min(self.workers, len(self.urls))
        source = iterate(torch_loader(stream, count, self.pin_memory) if count else stream, self.pin_memory,
                          Receiver(), self.timeout)
        try:
            for batch, meta in source:
                if batch is None and "error" in meta:
                    raise UsageError(meta["error"])
                counter.add(meta, batch)
                if batch is not None:
                    yield batch
        finally:
            del source
        if counter.stats["samples"] == 0:
            raise UsageError(f"--val-data: no usable samples in its {len(self.urls)} shard(s)")
        counter.close()


def data_index(cfg: DataConfig) -> DataIndex:
    """The shards of ``--train-data``, their sizes, sources and resampling weights: made once on rank 0 and given
    to every rank (``DataConfig.index``), so all cut their epochs from the same sizes."""
    sources = expand_sources(cfg.train_data, "--train-data")
    urls = [url for source in sources for url in source]
    seen = {}
    for url in urls:
        first = seen.setdefault(same_file(url), url)
        if first is not url:
            also = "" if first == url else f" (also as {first!r})"
            raise UsageError(f"--train-data lists shard {url!r} twice{also}: its samples would come twice an "
                             f"epoch, and could meet in one batch; list each shard once (to weight sources: "
                             f"--dataset-resampled with --train-data-upsampling-factors)")
    weights = shard_weights(sources, cfg.upsampling_factors, bool(cfg.dataset_resampled))
    # a pipe: command that hangs would hold the start for ever (with workers too: the count runs here)
    with bounded(cfg.timeout, "counting the shards' samples had not ended after"):
        sizes = shard_sizes(urls)
    index = DataIndex(urls, sizes, [k for k, source in enumerate(sources) for _ in source], weights)
    if index.total == 0:
        raise UsageError(f"--train-data: its {len(urls)} shard(s) hold no samples (a sample is a run of tar members "
                         f"with one key: an image .{'/.'.join(IMAGE_EXTS)} and a .txt caption)")
    return index


def _check_sizes(index: DataIndex, plan: Schedule, cfg: DataConfig, slots: int, epoch: int, target) -> None:
    """Refuse, in one line with the numbers, what the order cannot hold without a repeat inside a batch."""
    total, world, largest = index.total, cfg.world_size, max(plan.batch_sizes)
    if total < world * largest:
        raise UsageError(f"--train-data holds {total} samples, fewer than one batch ({world} rank(s) x {largest} at "
                         f"--naflex-seq-lens {min(plan.seq_lens)}): a batch would hold a sample twice; add data or "
                         f"lower --naflex-max-tokens-per-batch")
    if epoch == 0:
        if target[0] is None:
            what, fix = f"--naflex-num-train-image-tokens {target[1]}", "raise it"
        else:
            what = f"--train-num-samples {target[0]}" if target[0] != total else f"the data set's {total} samples"
            fix = "raise --train-num-samples" if target[0] != total else "add data"
        raise UsageError(f"{what} cannot fill one optimizer step ({world} rank(s) x {cfg.accum_freq} batches of "
                         f"up to {largest}); {fix}, or lower --accum-freq or --naflex-max-tokens-per-batch")
    share, window = total // slots, plan.window_rows
    if cfg.dataset_resampled and share < window:
        raise UsageError(f"--dataset-resampled: each of the {slots} data slots draws from its own {share} samples, "
                         f"fewer than one optimizer step's rows ({window}); lower --data-slots (or --workers), or "
                         f"add data")
    if not cfg.dataset_resampled and epoch > total and share < 2 * window:
        raise UsageError(f"an epoch of {epoch} samples spans passes over the {total}-sample data set, and each of the "
                         f"{slots} data slots' parts ({share}) must hold two optimizer steps' rows ({2 * window}) for "
                         f"passes to meet without a repeat inside a step; use --train-num-samples <= {total} with "
                         f"more --epochs, or lower --data-slots (or --workers)")


def check_data_config(cfg: DataConfig) -> Schedule:
    """The one check of ``cfg``'s settings that needs no data, each refused as its flag; the schedule they make.
    A train loader runs it first; the trainer runs it on its flags before it builds anything."""
    plan = Schedule(cfg)
    check_int(cfg.workers, "--workers", 0)
    check_int(cfg.rank, "rank", 0)
    if cfg.rank >= cfg.world_size:
        raise UsageError(f"rank {cfg.rank} is not below world_size {cfg.world_size}")
    check_int(cfg.sample_shuffle_size, "--sample-shuffle-size", 0)
    check_mode(cfg.image_decode)
    for flag, target in (("--train-num-samples", cfg.num_samples), ("--naflex-num-train-image-tokens",
                                                                    cfg.num_image_tokens)):
        if target is not None:
            check_int(target, flag)
    if cfg.num_samples is not None and cfg.num_image_tokens is not None:
        raise UsageError(f"give one of --train-num-samples ({cfg.num_samples}) or --naflex-num-train-image-tokens "
                         f"({cfg.num_image_tokens}), not both: each sizes the epoch")
    if cfg.slots is not None:
        check_slots(cfg.slots, cfg.world_size)
    if not (cfg.timeout >= 0 and cfg.timeout != float("inf")):
        raise UsageError(f"--data-timeout must be a number of seconds >= 0 (0: no limit); got {cfg.timeout}")
    upsampling_factors(cfg.upsampling_factors, len(str(cfg.train_data).split("::")), cfg.dataset_resampled)
    return plan


def make_train_loader(cfg: DataConfig, tokenizer: Callable, pin_memory: bool = False) -> TrainLoader:
    """The training loader for one rank (see TrainLoader); validates everything it can before any read."""
    return TrainLoader(cfg, tokenizer, pin_memory=pin_memory)


def make_val_loader(val_data: str, tokenizer: Callable, seq_len: int = 144, batch_size: int = 64,
                    patch_size: int = 16, workers: int = 0, pin_memory: bool = False,
                    decode: str = "scaled", timeout: float = 0.0, flatten: bool = True) -> ValLoader:
    """The held-out loader (see ValLoader); ``timeout``: as ``DataConfig.timeout`` (0: none)."""
    return ValLoader(val_data, tokenizer, seq_len, batch_size, patch_size, workers, pin_memory, decode, timeout,
                     flatten)
