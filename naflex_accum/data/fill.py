"""Filling a batch's rows: each row takes the sample at its position, or a stand-in where that one cannot serve.

Invariant: a row holds the sample at its global position (``slots.EpochOrder``)
unless that sample is unusable (``samples.checked`` refuses it, or its decode
raises) or, with resampling, one of its slot's rows of this batch already holds
it; then the row holds a stand-in: the next usable sample of the same slot's
pass after the slot's rows of this batch (then from the pass's start; with
resampling, from the rounds after). A stand-in's id is none that a position of
the batch holds, nor one another stand-in of the batch took: the slots' parts
are disjoint, one worker fills all of a slot's rows of a pass, and in a batch
that spans two passes a stand-in of pass ``q`` has an id of parity ``q`` (so the
two passes' stand-ins of one slot differ). So no batch holds a sample twice.
What the positions hold is computed, not read, so every worker and rank agrees
on it; a stand-in depends only on the data, so a resumed epoch takes the same
ones. Unusable samples are reported (``Corruption``) and stand-ins counted.
"""
from typing import Callable, Dict, Iterator, List, Set, Tuple

import numpy as np

from ..errors import UsageError
from .reading import Item, PassReader
from .samples import IMAGE_EXTS, Corruption, checked
from .slots import EpochOrder

# Unusable samples in a row before giving up: only a data set with (almost) nothing usable gets there.
MAX_CONSECUTIVE_FAILURES = 1000
_MIX = np.uint64(0x9E3779B97F4A7C15)


def parity(sample_id: int) -> int:
    """A fixed pseudo-random bit of a sample id (which pass of a straddling batch may take it as a stand-in)."""
    with np.errstate(over="ignore"):
        return int((np.uint64(sample_id) * _MIX) >> np.uint64(63))


class Readers:
    """This worker's open pass readers, one per (slot, pass)."""

    def __init__(self, order: EpochOrder):
        self.order = order
        self.open: Dict[Tuple[int, int], PassReader] = {}

    def get(self, slot: int, q: int, emission: int) -> Item:
        reader = self.open.get((slot, q))
        if reader is None:
            reader = self.open[(slot, q)] = PassReader(self.order.order(slot, q), self.order.window)
        return reader.get(emission)

    def advance(self, slot: int, q: int, emission: int) -> None:
        """A regular read of ``emission``: earlier windows of that pass, and the slot's earlier passes, are done."""
        reader = self.open.get((slot, q))
        if reader is not None:
            reader.forget_before(emission)
        for key in [k for k in self.open if k[0] == slot and k[1] < q]:
            self.open.pop(key).close()

    def close(self) -> None:
        for reader in self.open.values():
            reader.close()
        self.open = {}


class BatchFill:
    """The rows of the batch at global positions ``lo`` to ``hi`` that one worker fills."""

    def __init__(self, order: EpochOrder, readers: Readers, lo: int, hi: int, report: Corruption, flag: str,
                 failures: List[int]):
        self.order, self.readers, self.report, self.flag = order, readers, report, flag
        self.lo, self.hi = lo, hi
        self.straddles = not order.resampled and order.passes(lo) != order.passes(hi - 1)
        self._portions: Dict[int, Tuple[List[Tuple[int, int, int]], Dict[Tuple[int, int], int]]] = {}
        self.used: Dict[int, Set[int]] = {}
        self.standins = 0
        self.failures = failures  # [consecutive unusable samples], carried from batch to batch

    def portion(self, slot: int):
        """``(emission ranges, {(pass, emission): id})`` of ``slot``'s positions in this batch."""
        if slot not in self._portions:
            ranges = self.order.emissions(slot, self.lo, self.hi)
            ids: Dict[Tuple[int, int], int] = {}
            for q, first, end in ranges:
                found = self.order.order(slot, q).ids(np.arange(first, end)).tolist()
                ids.update(((q, e), i) for e, i in zip(range(first, end), found))
            self._portions[slot] = (ranges, ids)
        return self._portions[slot]

    def take(self, slot: int, q: int, emission: int, use: Callable):
        """``use(sample)`` for the row at ``(slot, q, emission)``: its own sample, else a stand-in's."""
        self.readers.advance(slot, q, emission)
        used = self.used.setdefault(slot, set())
        sample_id = self.portion(slot)[1][q, emission]
        if sample_id not in used:
            result = self._try(slot, q, emission, use)
            if result is not None:
                used.add(sample_id)
                return result
        for q2, e2, id2 in self._candidates(slot, q):
            result = self._try(slot, q2, e2, use)
            if result is not None:
                used.add(id2)
                self.standins += 1
                return result
        raise UsageError(f"{self.flag}: no usable sample left in slot {slot}'s part of the data set to stand in "
                         f"for an unusable one (each sample needs an image .{'/.'.join(IMAGE_EXTS)} and a "
                         f"non-empty .txt caption); last problem: {self.report.last}")

    def _try(self, slot: int, q: int, emission: int, use: Callable):
        key, url, files = self.readers.get(slot, q, emission)
        raw = None
        if key is None:
            self.report.add(url, None, files)
        else:
            raw = checked(url, key, files, self.report)
        if raw is not None:
            try:
                result = use(raw)
                self.failures[0] = 0
                return result
            except Exception as exc:  # truncated data, bad PNG chunks, decompression bombs: all "stand in"
                self.report.add(raw.url, raw.key, f"undecodable image ({type(exc).__name__}: {exc})")
        self.failures[0] += 1
        if self.failures[0] >= MAX_CONSECUTIVE_FAILURES:
            raise UsageError(f"{self.flag}: {self.failures[0]} images in a row failed to decode; last: "
                             f"{self.report.last}")
        return None

    def _candidates(self, slot: int, q: int) -> Iterator[Tuple[int, int, int]]:
        """``(pass, emission, id)`` of the stand-ins ``slot``'s pass ``q`` may offer, in order of preference."""
        ranges, positions = self.portion(slot)
        ids = set(positions.values())
        mine = [(first, end) for q_, first, end in ranges if q_ == q]
        first, end = mine[0][0], mine[-1][1]
        if self.order.resampled:  # the rounds after: at most as many draws as a few parts' worth
            spans = ((q + k, end if k == 0 else 0, None) for k in range(4 + 4 * len(self.order.parts[slot])))
        else:
            spans = iter([(q, end, None), (q, 0, first)])
        for q2, start, stop in spans:
            order = self.order.order(slot, q2)
            stop = order.length if stop is None else stop
            for at in range(start, stop, 256):
                chunk = np.arange(at, min(stop, at + 256))
                for e2, id2 in zip(chunk.tolist(), order.ids(chunk).tolist()):
                    if id2 in ids or id2 in self.used[slot]:
                        continue
                    if self.straddles and parity(id2) != q % 2:
                        continue
                    yield q2, e2, id2
