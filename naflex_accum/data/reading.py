"""Reading one slot's pass in its shuffled order: samples fetched by emission index, from shards read once.

Invariant: ``PassReader.get(j)`` is the sample at emission ``j`` of its pass (``slots.PassOrder``), or
``(None, url, reason)`` where the shard lacks it; requests in increasing order read each piece once, holding
what is read ahead a window at a time; a request behind the reading point re-reads that one sample.
``samples.ShardReadError`` propagates.
"""
from typing import Dict, Iterator, Optional, Tuple

from ..errors import first_line
from .samples import ShardReadError, shard_groups
from .slots import PassOrder

Item = Tuple[Optional[str], str, object]  # (key, url, {ext: bytes}), or (None, url, reason)


class PassReader:
    def __init__(self, order: PassOrder, window: int):
        self.order, self.window = order, max(1, window)
        self.held: Dict[int, Item] = {}
        self.cursor: Optional[int] = None  # the next reading index the open read yields
        self._reads: Optional[Iterator[Tuple[int, Item]]] = None
        self._kept_from = 0  # held items of emissions below this are dropped

    def get(self, emission: int) -> Item:
        r = int(self.order.emit[emission])
        if r in self.held:
            return self.held[r]
        if self.cursor is None:
            self._start(min(r, (emission // self.window) * self.window))
        if r < self.cursor:
            return self._fetch(r)
        while self.cursor <= r:
            at, item = next(self._reads)
            self.held[at] = item
            self.cursor = at + 1
        return self.held[r]

    def forget_before(self, emission: int) -> None:
        """Drop held samples emitted before ``emission``'s window: a regular read has passed them."""
        floor = (emission // self.window) * self.window
        if floor <= self._kept_from:
            return
        self._kept_from = floor
        for r in [r for r in self.held if self.order.emission_of(r) < floor]:
            del self.held[r]

    def _start(self, r: int) -> None:
        self.cursor = r
        self._reads = self._read_from(r)

    def _fetch(self, r: int) -> Item:
        reads = self._read_from(r)
        try:
            return next(reads)[1]
        finally:
            reads.close()

    def _read_from(self, r: int) -> Iterator[Tuple[int, Item]]:
        """``(reading index, item)`` from ``r`` to the pass's end, every index once, in order."""
        order = self.order
        k, local = order.piece_at(r)
        for piece_number in range(k, len(order.pieces)):
            piece = order.pieces[piece_number]
            url = order.index.urls[piece.shard]
            first = local if piece_number == k else piece.start
            base = int(order.starts[piece_number]) - piece.start
            expected = first
            reason = None
            try:
                for number, key, files in shard_groups(url, first, piece.stop):
                    yield base + number, (key, url, files)
                    expected = number + 1
            except ShardReadError:
                raise
            except Exception as exc:  # a damaged tar, a failed pipe: what the piece still lists is missing
                reason = f"cannot be read past sample {expected} ({first_line(exc, named=True)})"
            reason = reason or f"holds {expected} samples, fewer than its listed size"
            for number in range(expected, piece.stop):
                yield base + number, (None, url, f"sample {number} is missing: the shard {reason}")

    def close(self) -> None:
        if self._reads is not None:
            self._reads.close()
        self._reads, self.cursor, self.held = None, None, {}
