"""Batches from loader workers to the main process: patches in recycled shared memory, the rest in the message.

Invariant: a worker writes into one of its shared-memory slots only while no tensor in the main process is over
it (busy flag set by the worker, cleared when the last tensor over the batch goes: ``assemble.Lease``), so a
batch the trainer holds is never overwritten; a slot crosses once, later batches as a few numbers. With all
slots held, or a pinned loader, a batch goes in fresh shared memory; the main process gets the same batch
either way. With 0 workers the same slots serve in one process. Why: docs/data.md, "How batches reach the
training process".
"""
import functools
import operator
from typing import Dict, List, Optional, Set, Tuple

import numpy as np
import torch

from .assemble import Lease
from .patches import patch_grid

MAX_SLOTS = 16  # per worker: prefetched batches plus those the main process holds; beyond that, fresh memory


def new_flags(workers: int) -> torch.Tensor:
    """The busy flag of every (worker, slot), in shared memory: made in the main process before workers start."""
    return torch.zeros(max(1, workers), MAX_SLOTS, dtype=torch.int8).share_memory_()


def fresh_shared(numel: int) -> torch.Tensor:
    """A uint8 tensor (patch memory) of ``numel`` elements in new shared memory, which crosses to the main
    process without a copy (its never-written pages cost ~0.3 ms per 6 MB to move there: ``share_memory_``)."""
    return torch.empty(numel, dtype=torch.uint8).share_memory_()


class SlotRef:
    """A batch's patches in slot ``slot`` of worker ``worker`` (its first ``prod(shape)`` bytes); ``memory`` travels
    with a slot generation's first batch only. Not a tuple, so the pin-memory thread passes it as it is."""
    __slots__ = ("worker", "slot", "generation", "shape", "memory")

    def __init__(self, worker: int, slot: int, generation: int, shape: Tuple[int, ...],
                 memory: Optional[torch.Tensor]):
        self.worker, self.slot, self.generation, self.shape, self.memory = worker, slot, generation, shape, memory

    def __reduce__(self):
        return SlotRef, (self.worker, self.slot, self.generation, self.shape, self.memory)

    def pin_memory(self, device=None) -> "SlotRef":
        # A pinned copy of the slot's memory would go stale when the worker reuses the slot; the main
        # process pins the batch it builds from the slot instead.
        return self


class WorkerSlots:
    """One worker's slots: ``alloc(numel)`` is the buffer to collate a batch's patches into, ``pack`` what to send."""

    def __init__(self, flags: torch.Tensor, worker: int):
        self.worker, self.flags = worker, flags.numpy()[worker]
        self.memory: List[torch.Tensor] = []
        self.generations: List[int] = []
        self.unsent: Set[int] = set()
        self.pending: Optional[int] = None  # the slot of the batch being built

    def _slot(self, numel: int) -> Optional[int]:
        free = [s for s in range(len(self.memory)) if self.flags[s] == 0]
        fits = [s for s in free if self.memory[s].numel() >= numel]
        if fits:
            return fits[0]
        if len(self.memory) < MAX_SLOTS:
            self.memory.append(torch.empty(0))
            self.generations.append(-1)
            slot = len(self.memory) - 1
        elif free:  # every slot made, a free one too small: it grows
            slot = free[0]
        else:
            return None
        self.memory[slot] = fresh_shared(max(numel, max(m.numel() for m in self.memory)))
        self.generations[slot] += 1
        self.unsent.add(slot)
        return slot

    def alloc(self, numel: int) -> torch.Tensor:
        slot = self._slot(numel)
        self.pending = slot
        if slot is None:
            return fresh_shared(numel)
        self.flags[slot] = 1
        return self.memory[slot][:numel]

    def pack(self, item: Tuple[Optional[Dict], Dict]) -> Tuple[Optional[Dict], Dict]:
        """The batch just built, as it travels: its patches a ``SlotRef`` when they are in a slot."""
        batch, meta = item
        slot, self.pending = self.pending, None
        if batch is None or slot is None:
            return pack(item)
        memory = self.memory[slot] if slot in self.unsent else None
        self.unsent.discard(slot)  # if this message is lost the slot stays busy, so it is never referred to again
        patches = batch["image"]["patches"]
        ref = SlotRef(self.worker, slot, self.generations[slot], tuple(patches.shape), memory)
        return pack(({**batch, "image": {**batch["image"], "patches": ref}}, meta))


def pack(item: Tuple[Optional[Dict], Dict]) -> Tuple[Optional[Dict], Dict]:
    """In a worker: the batch's small tensors as numpy arrays inside the pickled message (torch's per-tensor fd
    passing costs more for a few KB); with ``meta["grid"]`` the coordinates and mask stay behind, rebuilt by the
    receiver (``naflex.patch_grid``)."""
    batch, meta = item
    if batch is None:
        return item
    image = batch["image"]
    if "grid" in meta:
        image = {key: value for key, value in image.items() if key not in ("patch_coord", "patch_valid")}
    else:
        image = {**image, "patch_coord": image["patch_coord"].numpy(), "patch_valid": image["patch_valid"].numpy()}
    return {"image": image, "text": batch["text"].numpy()}, meta


class Receiver:
    """The main process's side: each worker slot's memory, mapped once, and the batches over it; it lives as
    long as the workers whose ``WorkerSlots`` share ``flags``."""

    def __init__(self, flags: Optional[torch.Tensor] = None):
        self.flags = None if flags is None else flags.numpy()
        self.memory: Dict[Tuple[int, int], Tuple[int, np.ndarray]] = {}

    def patches(self, ref: SlotRef) -> torch.Tensor:
        key = (ref.worker, ref.slot)
        if ref.memory is not None:
            self.memory[key] = (ref.generation, ref.memory.numpy())
        generation, memory = self.memory.get(key, (None, None))
        if generation != ref.generation:
            raise RuntimeError(f"loader worker {ref.worker} sent a batch in slot {ref.slot} generation "
                               f"{ref.generation}, whose memory this process never received")
        # the slot is free again when the last tensor over this batch's patches is gone
        free = functools.partial(operator.setitem, self.flags[ref.worker], ref.slot, 0)
        lease = Lease(memory[:int(np.prod(ref.shape))], free)
        return torch.from_numpy(np.asarray(lease)).view(ref.shape)

    def __call__(self, batch: Dict, meta: Optional[Dict] = None) -> Dict:
        """A batch as a worker packed it, with tensors again (sharing the memory, no copy)."""
        def tensor(value):
            if isinstance(value, dict):
                return {key: tensor(v) for key, v in value.items()}
            if isinstance(value, SlotRef):
                return self.patches(value)
            return torch.from_numpy(value) if isinstance(value, np.ndarray) else value
        batch = tensor(batch)
        if "patch_coord" not in batch["image"] and meta is not None and "grid" in meta:
            counts, widths = zip(*meta["grid"])
            coord, valid = patch_grid(counts, widths, meta["seq_len"])
            batch["image"].update(patch_coord=coord, patch_valid=valid)
        return batch
