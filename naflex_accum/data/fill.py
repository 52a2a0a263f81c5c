"""Filling a batch's rows: each row takes the sample at its position, or a stand-in where that one cannot serve.

Invariant: no window (an optimizer step's microbatches, every rank's rows) holds a sample twice: a row holds
its position's sample (``slots.EpochOrder``) unless it is unusable or, resampled, already in the window; then a
stand-in from the same slot's pass, else another part's by ``owner``, whose ids no position or other stand-in
of the window holds. Stand-ins depend on the data alone, so ranks, workers and resumes agree; unusable rows
and stand-ins are counted. docs/data.md, "Corrupt data".
"""
from typing import Callable, Dict, Iterator, List, Optional, Set, Tuple

import numpy as np

from ..errors import UsageError
from .reading import Item, PassReader
from .samples import Corruption, checked
from .slots import EpochOrder

# Unusable samples in a row before giving up: only a data set with (almost) nothing usable gets there.
MAX_CONSECUTIVE_FAILURES = 1000
_MIX = 0x9E3779B97F4A7C15


def _mixed(sample_id: int) -> int:
    return (sample_id * _MIX) & 0xFFFFFFFFFFFFFFFF


def parity(sample_id: int) -> int:
    """A fixed pseudo-random bit of a sample id (which pass of a straddling window may take it as a stand-in)."""
    return _mixed(sample_id) >> 63


def owner(sample_id: int, slots: int) -> int:
    """The slot that may take ``sample_id`` as a stand-in from another slot's part (one slot per id)."""
    return (_mixed(sample_id) >> 20) % slots


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
    """The rows one worker fills of one contrastive batch: an optimizer step's window (its microbatches, every rank's
    rows), at global positions ``lo`` to ``hi``."""

    def __init__(self, order: EpochOrder, readers: Readers, lo: int, hi: int, report: Corruption, flag: str,
                 failures: List[int]):
        self.order, self.readers, self.report, self.flag = order, readers, report, flag
        self.lo, self.hi = lo, hi
        self.straddles = not order.resampled and order.passes(lo) != order.passes(hi - 1)
        self._portions: Dict[int, Tuple[List[Tuple[int, int, int]], Dict[Tuple[int, int], int]]] = {}
        self._window_ids: Optional[Set[int]] = None
        self.used: Dict[int, Set[int]] = {}
        self.unusable = 0  # rows whose own sample could not serve
        self.standins = 0  # rows that took a stand-in (their sample unusable, or with resampling a repeat)
        self.failures = failures  # [consecutive unusable samples], carried from window to window

    def portion(self, slot: int):
        """``(emission ranges, {(pass, emission): id})`` of ``slot``'s positions in this window."""
        if slot not in self._portions:
            ranges = self.order.emissions(slot, self.lo, self.hi)
            ids: Dict[Tuple[int, int], int] = {}
            for q, first, end in ranges:
                found = self.order.order(slot, q).ids(np.arange(first, end)).tolist()
                ids.update(((q, e), i) for e, i in zip(range(first, end), found))
            self._portions[slot] = (ranges, ids)
        return self._portions[slot]

    def window_ids(self) -> Set[int]:
        """The ids at every position of the window, every slot's (for stand-ins from other slots' parts)."""
        if self._window_ids is None:
            self._window_ids = {i for slot in range(self.order.slots) for i in self.portion(slot)[1].values()}
        return self._window_ids

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
            self.unusable += 1
        for q2, e2, id2, part in self._candidates(slot, q):
            result = self._try(part, q2, e2, use)
            if result is not None:
                used.add(id2)
                self.standins += 1
                return result
        if self.report.last is None:
            raise UsageError(f"{self.flag}: slot {slot}'s draws repeat the samples already in one optimizer step's "
                             f"window (its part holds {self.order.part_size(slot)}); lower --data-slots (or "
                             f"--workers), or the spread of --train-data-upsampling-factors")
        raise UsageError(f"{self.flag}: no usable sample left to stand in for an unusable one in slot {slot}'s "
                         f"window; last problem: {self.report.last}")

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

    def _candidates(self, slot: int, q: int) -> Iterator[Tuple[int, int, int, int]]:
        """``(pass, emission, id, slot read)`` of the stand-ins for ``slot``'s pass ``q``, best first: its own part's
        samples after its rows, then other parts' whose id ``owner`` gives to this slot (no two slots pick one)."""
        ranges, positions = self.portion(slot)
        taken = set(positions.values())
        mine = [(first, end) for q_, first, end in ranges if q_ == q]
        first, end = mine[0][0], mine[-1][1]
        if self.order.resampled:  # the rounds after: at most as many draws as a few parts' worth
            spans = [(slot, q + k, end if k == 0 else 0, None) for k in range(4 + 4 * len(self.order.parts[slot]))]
        else:
            spans = [(slot, q, end, None), (slot, q, 0, first)]
        others = [(slot + k) % self.order.slots for k in range(1, self.order.slots)]
        spans += [(t, q if not self.order.resampled else 0, 0, None) for t in others]
        for part, q2, start, stop in spans:
            order = self.order.order(part, q2)
            stop = order.length if stop is None else stop
            for at in range(start, stop, 256):
                chunk = np.arange(at, min(stop, at + 256))
                for e2, id2 in zip(chunk.tolist(), order.ids(chunk).tolist()):
                    if id2 in taken or id2 in self.used[slot]:
                        continue
                    if part != slot and (owner(id2, self.order.slots) != slot or id2 in self.window_ids()):
                        continue
                    if self.straddles and parity(id2) != q % 2:
                        continue
                    yield q2, e2, id2, part
