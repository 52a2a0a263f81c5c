"""Which samples each data slot reads in an epoch, and in which order: the epoch's global sample order.

Invariant: the sample at every position is a pure function of the shards and sizes, the seed, the epoch, the
slots ``C`` and the shuffle window, never of the world size, workers or reads. Unresampled, the data set is cut
into ``C`` parts and each pass of a slot reads its part once, shuffled within windows, so a pass holds each
sample once and passes meet without a repeat within ``tail``; resampled, a slot draws its pieces with
replacement. Two slots never share a sample. docs/data.md, "What an epoch is".
"""
import bisect
from functools import lru_cache
from typing import List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from ..errors import UsageError
from .index import canonical
from .schedule import derive_seed


class Piece(NamedTuple):
    """Samples ``start`` to ``stop`` (exclusive) of shard ``shard``."""
    shard: int
    start: int
    stop: int


def _rng(*parts) -> np.random.RandomState:
    seed = derive_seed(*parts)
    return np.random.RandomState([seed & 0xFFFFFFFF, seed >> 32])  # numpy's legacy stream: frozen across versions


def part_sizes(total: int, slots: int) -> List[int]:
    """How many of the positions ``0 .. total - 1`` fall to each slot (position ``o`` to slot ``o % slots``)."""
    return [max(0, (total - s + slots - 1) // slots) for s in range(slots)]


def _cut(pieces: Sequence[Piece], sizes: Sequence[int]) -> List[List[Piece]]:
    """``pieces`` read in order, cut into consecutive parts of ``sizes`` samples."""
    parts, k, used = [], 0, 0
    for size in sizes:
        part = []
        while size > 0:
            shard, start, stop = pieces[k]
            take = min(size, stop - start - used)
            part.append(Piece(shard, start + used, start + used + take))
            size -= take
            used += take
            if used == stop - start:
                k, used = k + 1, 0
        parts.append(part)
    return parts


def _rotated(pieces: List[Piece], rng: np.random.RandomState) -> List[Piece]:
    """``pieces`` read from a seeded point on and round to it: which samples a pass's last reads are (an epoch's
    untrained remainder) then falls anywhere in a shard, not always at its end."""
    total = sum(p.stop - p.start for p in pieces)
    if total < 2:
        return pieces
    at = int(rng.randint(total))
    for k, (shard, start, stop) in enumerate(pieces):
        if at < stop - start:
            head = [Piece(shard, start + at, stop)] + pieces[k + 1:] + pieces[:k]
            return head + ([Piece(shard, start, start + at)] if at else [])
        at -= stop - start
    return pieces


class DataIndex:
    """The shards (URLs), their sample counts and sources; sample ``i`` of shard ``k`` has id ``offsets[k] + i``."""

    def __init__(self, urls: Sequence[str], counts: Sequence[int], sources: Optional[Sequence[int]] = None,
                 weights: Optional[Sequence[float]] = None):
        self.urls, self.counts = list(urls), [int(c) for c in counts]
        self.sources = list(sources) if sources is not None else [0] * len(self.urls)
        self.weights = list(weights) if weights is not None else None  # per shard: its source's factor
        self.offsets = np.concatenate([[0], np.cumsum(self.counts, dtype=np.int64)])
        self.total = int(self.offsets[-1])

    def listing(self) -> List[list]:
        """``[name, count]`` per shard (``index.canonical``): what a checkpoint records to recognise the data."""
        return [[canonical(url), count] for url, count in zip(self.urls, self.counts)]


class PassOrder:
    """One slot's pass (or resampled round): pieces in reading order and each emission's reading index."""

    def __init__(self, index: DataIndex, pieces: Sequence[Piece], emit: np.ndarray):
        self.index, self.pieces, self.emit = index, list(pieces), emit
        self.starts = np.concatenate([[0], np.cumsum([p.stop - p.start for p in self.pieces], dtype=np.int64)])
        self.length = int(self.starts[-1])
        self._inverse = None

    def piece_at(self, r: int) -> Tuple[int, int]:
        """``(piece number, sample number in its shard)`` of reading index ``r``."""
        k = bisect.bisect_right(self.starts, r) - 1
        return k, self.pieces[k].start + r - int(self.starts[k])

    def ids(self, emissions) -> np.ndarray:
        """The sample ids at ``emissions`` (an array of emission indices)."""
        reading = self.emit[np.asarray(emissions, dtype=np.int64)]
        k = np.searchsorted(self.starts, reading, side="right") - 1
        shards = np.array([p.shard for p in self.pieces], dtype=np.int64)[k]
        local = np.array([p.start for p in self.pieces], dtype=np.int64)[k] + reading - self.starts[k]
        return self.index.offsets[shards] + local

    def emission_of(self, r: int) -> int:
        if self._inverse is None:
            self._inverse = np.empty_like(self.emit)
            self._inverse[self.emit] = np.arange(len(self.emit))
        return int(self._inverse[r])


def window_order(n: int, window: int, rng: np.random.RandomState) -> np.ndarray:
    """Emission -> reading index: each run of ``window`` consecutive reads emitted in a seeded random order."""
    if window <= 1 or n <= 1:
        return np.arange(n, dtype=np.int64)
    keys = rng.random_sample(n)
    return np.lexsort((keys, np.arange(n) // window)).astype(np.int64)


def keep_apart(order: PassOrder, previous: PassOrder, tail: int, where: str) -> None:
    """Swap ``order``'s first ``tail`` emissions that hold one of ``previous``'s last ``tail`` samples with
    its nearest later emissions that hold none (in place)."""
    n = order.length
    if n < 2 * tail:
        raise UsageError(f"{where}: a slot's part ({n} samples) is shorter than two batches ({2 * tail}), so "
                         f"passes cannot meet without a sample twice in one batch")
    last = previous.ids(np.arange(previous.length - tail, previous.length))
    held = np.isin(order.ids(np.arange(n)), last)
    conflicts = np.flatnonzero(held[:tail])
    partners = tail + np.flatnonzero(~held[tail:])[:len(conflicts)]
    order.emit[conflicts], order.emit[partners] = order.emit[partners].copy(), order.emit[conflicts].copy()
    order._inverse = None


class EpochOrder:
    """Epoch ``epoch``'s order (module docstring): ``locate`` a position, ``order`` a slot's pass or round."""

    def __init__(self, index: DataIndex, seed: int, epoch: int, slots: int, window: int, tail: int,
                 resampled: bool = False):
        self.index, self.seed, self.epoch, self.slots = index, seed, epoch, slots
        self.window, self.tail, self.resampled = window, tail, resampled
        self.total = index.total
        self.parts = self._resampled_parts() if resampled else self._parts()
        self._rounds = [[0] for _ in range(slots)]  # resampled: each slot's round ends, in emissions
        self.order = lru_cache(maxsize=4 * slots + 8)(self._order)

    def _parts(self) -> List[List[Piece]]:
        shards = _rng("parts", self.seed, self.epoch).permutation(len(self.index.urls))
        pieces = [Piece(int(k), 0, self.index.counts[k]) for k in shards if self.index.counts[k]]
        return _cut(pieces, part_sizes(self.total, self.slots))

    def _resampled_parts(self) -> List[List[Piece]]:
        parts = [[] for _ in range(self.slots)]
        for source in sorted(set(self.index.sources)):
            shards = [k for k, s in enumerate(self.index.sources) if s == source and self.index.counts[k]]
            order = _rng("parts", self.seed, self.epoch, source).permutation(len(shards))
            pieces = [Piece(shards[i], 0, self.index.counts[shards[i]]) for i in order]
            size = sum(p.stop - p.start for p in pieces)
            for part, cut in zip(parts, _cut(pieces, part_sizes(size, self.slots))):
                part.extend(cut)
        return parts

    def part_size(self, slot: int) -> int:
        return sum(p.stop - p.start for p in self.parts[slot])

    def passes(self, position: int) -> int:
        """The pass (0 with resampling) that global position ``position`` falls in."""
        return 0 if self.resampled else position // self.total

    def locate(self, position: int) -> Tuple[int, int, int]:
        """``(slot, pass or round, emission)`` of global position ``position``."""
        if self.resampled:
            slot, stream = position % self.slots, position // self.slots
            return (slot,) + self._round_of(slot, stream)
        q, o = divmod(position, self.total)
        return o % self.slots, q, o // self.slots

    def emissions(self, slot: int, lo: int, hi: int) -> List[Tuple[int, int, int]]:
        """``(pass, first, end)`` emission ranges of ``slot`` at the global positions ``lo`` to ``hi``."""
        out, c = [], self.slots
        if self.resampled:
            first, end = -(-(lo - slot) // c), -(-(hi - slot) // c)
            while first < end:
                q, j = self._round_of(slot, first)
                take = min(end - first, self._rounds[slot][q + 1] - self._rounds[slot][q] - j)
                out.append((q, j, j + take))
                first += take
            return out
        for q in range(lo // self.total, (hi - 1) // self.total + 1):
            o0, o1 = max(lo, q * self.total) - q * self.total, min(hi, (q + 1) * self.total) - q * self.total
            first, end = -(-(o0 - slot) // c), -(-(o1 - slot) // c)
            if end > first:
                out.append((q, first, end))
        return out

    def _round_of(self, slot: int, stream: int) -> Tuple[int, int]:
        ends = self._rounds[slot]
        while ends[-1] <= stream:
            ends.append(ends[-1] + self.order(slot, len(ends) - 1).length)
        q = bisect.bisect_right(ends, stream) - 1
        return q, stream - ends[q]

    def _order(self, slot: int, q: int) -> PassOrder:
        part = self.parts[slot]
        if self.resampled:
            rng = _rng("round", self.seed, self.epoch, slot, q)
            sizes = np.array([p.stop - p.start for p in part], dtype=np.float64)
            weights = sizes * np.array([self._factor(p.shard) for p in part])
            pieces = [part[i] for i in rng.choice(len(part), size=len(part), p=weights / weights.sum())]
        else:
            rng = _rng("pass", self.seed, self.epoch, slot, q)
            pieces = _rotated([part[i] for i in rng.permutation(len(part))], rng)
        order = PassOrder(self.index, pieces, np.empty(0, dtype=np.int64))
        order.emit = window_order(order.length, self.window, rng)
        if q > 0 and not self.resampled:
            keep_apart(order, self.order(slot, q - 1), self.tail, "--train-data")
        return order

    def _factor(self, shard: int) -> float:
        return 1.0 if self.index.weights is None else float(self.index.weights[shard])
