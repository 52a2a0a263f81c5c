"""Batches as they reach the main process: torch's DataLoader around a stream, received, pinned, counted.

Invariant: workers ignore SIGTERM, SIGUSR1 and SIGINT (the main process decides when a run stops) and freeze
their inherited heap; a wait past the timeout stops them (``workers``, ``alarm``); a dead worker is one line at
the next batch; unusable samples are counted, logged one by one up to ``LOG_LIMIT``.
"""
import functools
import gc
import logging
import multiprocessing
import signal
from typing import Dict, Iterator, Optional

import torch

from ..interrupt import deferred
from .alarm import bounded
from .handover import Receiver
from .pipes import die_with
from .workers import context, lost, of, raise_pending, read_failed, register as register_workers

log = logging.getLogger(__name__)
LOG_LIMIT = 20


def _passthrough(batch):
    return batch


class EpochCounter:
    """Per-epoch counters and rate-limited warnings for corrupt samples (stand-ins in training, skips held-out)."""

    def __init__(self, what: str, epoch: Optional[int] = None):
        self.what, self.logged, self.train = what, set(), epoch is not None
        self.stats = {"batches": 0, "samples": 0, "image_tokens": 0, "corrupt": 0}
        if self.train:
            self.stats = {"epoch": epoch, **self.stats, "standins": 0}

    def add(self, meta: Dict, batch: Optional[Dict]):
        if batch is not None:
            self.stats["batches"] += 1
            self.stats["samples"] += meta["samples"]
            self.stats["image_tokens"] += meta["image_tokens"]
        self.stats["corrupt"] += meta.get("corrupt", 0)
        if self.train:
            self.stats["standins"] += meta.get("standins", 0)
        what = "unusable" if self.train else "skipped"
        for message in meta.get("messages", ()):
            # Resampled shards repeat their bad samples: each distinct one is logged once an epoch.
            if message in self.logged or len(self.logged) > LOG_LIMIT:
                continue
            self.logged.add(message)
            if len(self.logged) <= LOG_LIMIT:
                log.warning("%s: %s %s", self.what, what, message)
            else:
                log.warning("%s: further unusable samples are counted, not logged one by one", self.what)

    def close(self):
        if not self.stats["corrupt"] and not self.stats.get("standins"):
            return
        if self.train:
            log.warning("%s: %d rows' samples were unusable; %d rows took a stand-in (another sample of their "
                        "slot; %d rows in all)", self.what, self.stats["corrupt"], self.stats["standins"],
                        self.stats["samples"])
        else:
            log.warning("%s: skipped %d corrupt samples (%d used)", self.what, self.stats["corrupt"],
                        self.stats["samples"])


def freeze_heap() -> None:
    """In a loader worker: exempt the inherited heap from the cyclic collector (a full collection walks ~400,000
    objects, 0.2 s, and copies their pages); the training process freezes nothing (its first collection costs more)."""
    gc.freeze()


def init_worker(worker_id: int) -> None:
    """Freeze the inherited heap, and leave stopping to the main process: a SIGTERM, SIGUSR1 or SIGINT sent to
    the whole process group (SLURM, Kubernetes, a terminal) must not kill a worker under it, nor make it print.
    A worker started by the main thread dies with its process (a killed rank's copies of its connections close
    with it, even mid-read)."""
    freeze_heap()
    if getattr(multiprocessing.current_process(), "dies_with_parent", False):
        die_with(multiprocessing.parent_process().pid, signal.SIGKILL)
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)


def pinned(batch):
    if isinstance(batch, dict):
        return {key: pinned(value) for key, value in batch.items()}
    return batch.pin_memory() if isinstance(batch, torch.Tensor) else batch


def torch_loader(dataset, workers: int, pin_memory: bool, persistent: bool = False):
    """torch's DataLoader, its worker processes started through a recording ``workers.context()``."""
    return torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=workers, collate_fn=_passthrough,
                                       pin_memory=pin_memory and torch.cuda.is_available(),
                                       persistent_workers=persistent, worker_init_fn=init_worker,
                                       multiprocessing_context=context() if workers else None)


def iterate(source, pin_memory: bool, receive: Receiver, timeout: float = 0.0) -> Iterator:
    """``(batch, meta)`` from ``source`` (a dataset, or a DataLoader over one); pinned if asked (and CUDA is);
    a wait over ``timeout`` seconds (0: none) stops the workers (``workers``) or the in-process read (``alarm``)."""
    with deferred():  # a Ctrl-C while the workers start acts once they are registered, so they get stopped
        loader, source = source, iter(source)
        processes = of(loader)
        watch = register_workers(source, processes, timeout)  # a failure names its worker; the run's end stops all
    waiting = watch.waiting if processes else functools.partial(bounded, timeout)
    pin = pin_memory and torch.cuda.is_available()
    while True:
        raise_pending()  # a worker that died while the batch before was used fails the run here
        with waiting():
            try:
                item = next(source, None)
            except Exception as exc:
                dead = lost(processes) if read_failed(exc) else None
                if dead is None:
                    raise
                raise dead from exc
        raise_pending()
        if item is None:
            return
        batch, meta = item
        if batch is not None:
            batch = receive(batch, meta)
            # the DataLoader's pin thread has pinned the patches already (pin_memory keeps those as they are)
            batch = pinned(batch) if pin else batch
        yield batch, meta
