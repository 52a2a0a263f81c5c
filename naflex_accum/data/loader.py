"""The main-process side: ``make_train_loader`` / ``make_val_loader`` and the loaders they return.

Invariant: a train loader yields exactly ``num_batches`` batches per epoch, in
schedule order (batch i is the schedule's spec i, whichever worker built it),
the same count on every rank; each batch is ``{"image": {...}, "text": ...}``
and nothing else. ``stats`` counts what this process received this epoch,
including corrupt samples reported by workers, which are also logged (the
first ``LOG_LIMIT`` distinct ones of an epoch individually, then a summary).
"""
import logging
import signal
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch

from ..errors import UsageError
from .pipeline import TrainStream, ValStream
from .schedule import BatchSpec, DataConfig, Schedule
from .shards import dataset_size, expand_urls

log = logging.getLogger("naflex_accum.data")
LOG_LIMIT = 20


def _passthrough(batch):
    return batch


def _check_int(value, flag: str, minimum: int):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UsageError(f"{flag} must be an integer >= {minimum}, got {value!r}")
    return value


class _Counter:
    """Per-epoch counters and the rate-limited warnings for corrupt samples."""

    def __init__(self, what: str, epoch: Optional[int] = None):
        self.what, self.logged = what, set()
        self.stats = {"batches": 0, "samples": 0, "image_tokens": 0, "corrupt": 0}
        if epoch is not None:
            self.stats = {"epoch": epoch, **self.stats}

    def add(self, meta: Dict, batch: Optional[Dict]):
        if batch is not None:
            self.stats["batches"] += 1
            self.stats["samples"] += meta["samples"]
            self.stats["image_tokens"] += meta["image_tokens"]
        self.stats["corrupt"] += meta.get("corrupt", 0)
        for message in meta.get("messages", ()):
            # Resampled shards repeat their bad samples: each distinct one is logged once an epoch.
            if message in self.logged or len(self.logged) > LOG_LIMIT:
                continue
            self.logged.add(message)
            if len(self.logged) <= LOG_LIMIT:
                log.warning("%s: skipped %s", self.what, message)
            else:
                log.warning("%s: further corrupt samples are counted in stats['corrupt'] only", self.what)

    def close(self):
        if self.stats["corrupt"]:
            log.warning("%s: skipped %d corrupt samples (%d used)", self.what, self.stats["corrupt"],
                        self.stats["samples"])


def _ignore_stop_signals(worker_id: int) -> None:
    """The trainer's main process decides when a run stops (finish the step, save, exit): a SIGTERM or
    SIGUSR1 sent to the whole process group (SLURM, Kubernetes) must not kill a worker under it."""
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)


def _iterate(dataset, workers: int, pin_memory: bool) -> Iterator:
    if workers == 0:
        return iter(dataset)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=workers,
                                         collate_fn=_passthrough, pin_memory=pin_memory,
                                         worker_init_fn=_ignore_stop_signals)
    return iter(loader)


class TrainLoader:
    """One rank's training batches; ``set_epoch`` picks the epoch (and the first batch), iterating yields its batches.

    ``iter_meta()`` yields ``(batch, meta)`` instead, ``meta`` holding the batch's
    ``index`` in the epoch and its ``samples`` and ``image_tokens`` counted on the
    CPU, so a training loop needs no device sync to count them.
    """

    def __init__(self, cfg: DataConfig, tokenizer: Callable, pin_memory: bool = False):
        self.cfg, self.tokenizer, self.pin_memory = cfg, tokenizer, pin_memory
        self._plan = Schedule(cfg)
        _check_int(cfg.workers, "--workers", 0)
        _check_int(cfg.rank, "rank", 0)
        if cfg.rank >= cfg.world_size:
            raise UsageError(f"rank {cfg.rank} is not below world_size {cfg.world_size}")
        _check_int(cfg.shuffle_buffer, "shuffle_buffer", 0)
        self.urls = expand_urls(cfg.train_data, "--train-data")
        num_samples, num_tokens = cfg.num_samples, cfg.num_image_tokens
        if num_samples is not None and num_tokens is not None:
            raise UsageError(f"give one of --train-num-samples ({num_samples}) or --naflex-num-train-image-tokens "
                             f"({num_tokens}), not both: each sizes the epoch")
        if num_samples is None and num_tokens is None:
            num_samples = dataset_size(self.urls)
            if not num_samples:
                raise UsageError("one of --train-num-samples or --naflex-num-train-image-tokens is needed to size "
                                 "an epoch (the shards have no open_clip sizes.json listing them all)")
        self.num_batches = self._plan.num_batches_for(num_samples, num_tokens)
        samples, tokens = self._plan.totals(self.num_batches)
        self.num_samples = samples * cfg.world_size        # global, every epoch alike (stratified schedule)
        self.num_token_slots = tokens * cfg.world_size     # global batch_size * seq_len summed over the epoch
        self.epoch, self.start_batch = 0, 0
        self.stats = _Counter("--train-data", 0).stats

    def __len__(self) -> int:
        return self.num_batches

    def set_epoch(self, epoch: int, start_batch: int = 0):
        """Iterate epoch ``epoch`` from its batch ``start_batch`` on (a resume inside the epoch).

        The batches yielded are exactly those the whole epoch yields from that index on.
        """
        self.epoch = _check_int(epoch, "epoch", 0)
        start_batch = _check_int(start_batch, "start_batch", 0)
        if start_batch > self.num_batches:
            raise UsageError(f"cannot start epoch {epoch} at batch {start_batch}: it has {self.num_batches} batches")
        self.start_batch = start_batch

    def schedule(self, epoch: Optional[int] = None) -> List[BatchSpec]:
        return self._plan.epoch(self.epoch if epoch is None else epoch, self.num_batches)

    def stream(self) -> TrainStream:
        cfg = self.cfg
        return TrainStream(self.urls, self._plan, self.num_batches, self.epoch, cfg.rank, cfg.world_size,
                           cfg.workers, cfg.shuffle_buffer, self.tokenizer)

    def __iter__(self) -> Iterator[Dict]:
        return (batch for batch, _ in self.iter_meta())

    def iter_meta(self) -> Iterator[Tuple[Dict, Dict]]:
        counter = _Counter(f"--train-data (epoch {self.epoch}, rank {self.cfg.rank})", self.epoch)
        self.stats = counter.stats
        source = _iterate(self.stream(), self.cfg.workers, self.pin_memory)
        pending, expected = {}, 0
        try:
            for batch, meta in source:
                if batch is None:
                    raise UsageError(meta["error"])
                # The DataLoader delivers in order already; the buffer makes that a guarantee, not an assumption.
                pending[meta["index"]] = (batch, meta)
                while expected in pending:
                    batch, meta = pending.pop(expected)
                    counter.add(meta, batch)
                    expected += 1
                    if meta["index"] >= self.start_batch:
                        yield batch, meta
        finally:
            del source
        if expected != self.num_batches or pending:
            raise RuntimeError(f"train loader yielded {expected} of {self.num_batches} batches "
                               f"({len(pending)} out of order)")
        counter.close()


class ValLoader:
    """Every held-out sample once, in a fixed order, in batches of ``batch_size`` (the last may be smaller)."""

    def __init__(self, val_data: str, tokenizer: Callable, seq_len: int = 144, batch_size: int = 64,
                 patch_size: int = 16, workers: int = 0, pin_memory: bool = False):
        self.urls = expand_urls(val_data, "--val-data")
        self.seq_len = _check_int(seq_len, "val seq_len", 1)
        self.batch_size = _check_int(batch_size, "val batch_size", 1)
        self.patch_size = _check_int(patch_size, "val patch_size", 1)
        self.workers = _check_int(workers, "--workers", 0)
        self.tokenizer, self.pin_memory = tokenizer, pin_memory
        self._num_samples = None
        self.stats = _Counter("--val-data").stats

    @property
    def num_samples(self) -> int:
        """Samples with an image and a caption: from sizes.json if it lists every shard, else one read of the shards."""
        if self._num_samples is None:
            count = dataset_size(self.urls)
            if count is None:
                from .samples import Corruption, shard_samples
                count = sum(1 for url in self.urls for _ in shard_samples(url, Corruption()))
            self._num_samples = count
        return self._num_samples

    def __iter__(self) -> Iterator[Dict]:
        counter = _Counter("--val-data")
        self.stats = counter.stats
        stream = ValStream(self.urls, self.seq_len, self.batch_size, self.patch_size, self.tokenizer)
        source = _iterate(stream, min(self.workers, len(self.urls)), self.pin_memory)
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


def make_train_loader(cfg: DataConfig, tokenizer: Callable, pin_memory: bool = False) -> TrainLoader:
    """The training loader for one rank (see TrainLoader); validates everything it can before any read."""
    return TrainLoader(cfg, tokenizer, pin_memory=pin_memory)


def make_val_loader(val_data: str, tokenizer: Callable, seq_len: int = 144, batch_size: int = 64,
                    patch_size: int = 16, workers: int = 0, pin_memory: bool = False) -> ValLoader:
    """The held-out loader (see ValLoader)."""
    return ValLoader(val_data, tokenizer, seq_len, batch_size, patch_size, workers, pin_memory)
