"""One shared buffer per batch that all loader workers of a rank write their rows into: no assembly copy.

Invariant: a worker writes into ring buffer ``b`` only if the main process assigned ``b`` to exactly that batch
of this iteration (``lookup``, one 64-bit word); a buffer is assigned only while no tensor is over it and no
worker can still write into it (``begin`` holds back an old iteration's). A batch without a buffer takes the
worker's slot and is copied: the batch is bit for bit the same. Made before the workers start.
"""
import functools
from typing import Dict, List, Optional, Set

import numpy as np
import torch

from .assemble import Lease
from .handover import fresh_shared


def _word(generation: int, index: int, buffer: int) -> int:
    return ((generation & 0xFFFFFF) << 40) | ((index & 0xFFFFFFFF) << 8) | buffer


class Ring:
    """``buffers`` shared uint8 buffers of ``capacity`` bytes; batches ``lookahead`` ahead get one assigned."""

    def __init__(self, buffers: int, capacity: int, lookahead: int):
        if not 0 < buffers < 256:
            raise ValueError(f"a ring holds 1 to 255 buffers, not {buffers}")
        self.capacity, self.lookahead = capacity, lookahead
        self.memory = [fresh_shared(capacity) for _ in range(buffers)]  # pages are touched only when written
        self.table = torch.full((lookahead,), -1, dtype=torch.int64).share_memory_()
        self.free: List[int] = list(range(buffers))[::-1]  # main only; a stack: the last freed is reused first
        self.assigned: Dict[int, int] = {}  # batch index -> buffer, main only
        self.held: List[int] = []  # assigned in an earlier iteration and never received
        self.waiting: Set[int] = set()  # workers yet to send a part of this iteration
        self.generation, self.end = 0, 0

    # ---- main process ------------------------------------------------------------------------------------

    def begin(self, generation: int, first: int, end: int, workers: int) -> None:
        """A new iteration over batches ``first`` to ``end`` - 1: drop the old entries, assign the first ones."""
        self.table.fill_(-1)
        self.held.extend(self.assigned.values())
        self.assigned.clear()
        self.generation, self.end, self.waiting = generation, end, set(range(workers))
        for index in range(first, min(end, first + self.lookahead)):
            self.assign(index)

    def assign(self, index: int) -> None:
        if index >= self.end or index in self.assigned or not self.free:
            return
        buffer = self.free.pop()
        self.assigned[index] = buffer
        self.table[index % self.lookahead] = _word(self.generation, index, buffer)

    def received(self, worker: Optional[int]) -> None:
        """A part of this iteration came from ``worker``: once every worker has sent one, old buffers are free."""
        self.waiting.discard(worker)
        if not self.waiting and self.held:
            self.free.extend(self.held)
            self.held.clear()

    def take(self, index: int, numel: int, shape) -> Optional[torch.Tensor]:
        """The batch's buffer as a tensor of ``shape`` (freed when the last tensor over it is gone), if it has one;
        then the batch ``lookahead`` further on gets a buffer."""
        buffer = self.assigned.pop(index, None)
        self.table[index % self.lookahead] = -1  # no worker reads it again; a stale entry must not match later
        self.assign(index + self.lookahead)
        if buffer is None:
            return None
        if numel > self.capacity:  # cannot happen with the capacity the loader computes; the copy path is safe
            self.free.append(buffer)
            return None
        view = self.memory[buffer].numpy()[:numel]
        return torch.from_numpy(np.asarray(Lease(view, functools.partial(self.free.append, buffer)))).view(shape)

    # ---- worker --------------------------------------------------------------------------------------------

    def lookup(self, generation: int, index: int) -> Optional[int]:
        """The buffer assigned to batch ``index`` of iteration ``generation``, or None."""
        word = int(self.table[index % self.lookahead])
        buffer = word & 0xFF
        return buffer if word >= 0 and word == _word(generation, index, buffer) else None
