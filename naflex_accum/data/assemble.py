"""A batch from the parts the loader workers of a rank built of it (``pipeline``).

Invariant: row ``t`` of the batch is the part row ``meta["rows"]`` places at ``t``, so a batch is bit for bit
the same whatever the number of workers; a batch built by one part passes uncopied, else each part is copied
once into memory a ``Pool`` recycles (fresh memory costs a page fault per 4 KB, ten times the copy).
"""
import functools
import math
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

BIG_ROW = 1 << 15  # bytes per row from which rows are copied one by one (index_copy_ is slower on big rows)


class Lease:
    """Keeps ``view``'s memory alive while any tensor over it lives (``torch.from_numpy(np.asarray(lease))``),
    then calls ``release`` once: the memory can be reused."""
    __slots__ = ("__array_interface__", "_view", "_release")

    def __init__(self, view: np.ndarray, release: Callable[[], None]):
        self.__array_interface__ = view.__array_interface__
        self._view, self._release = view, release

    def __del__(self):
        try:
            self._release()
        except Exception:  # interpreter shutdown: nobody is left to reuse the memory
            pass


class Pool:
    """Recycled memory for assembled uint8 patches: at most ``keep`` free buffers are kept."""

    def __init__(self, keep: int = 8, dtype: torch.dtype = torch.uint8):
        self.free: List[np.ndarray] = []
        self.keep, self.dtype = keep, dtype

    def empty(self, shape: Tuple[int, ...]) -> torch.Tensor:
        numel = math.prod(shape)
        fits = [i for i, b in enumerate(self.free) if numel <= b.size <= 2 * numel]  # sizes follow a token budget
        if fits:
            buffer = self.free.pop(min(fits, key=lambda i: self.free[i].size))
        else:
            buffer = torch.empty(numel, dtype=self.dtype).numpy()
        del self.free[:-self.keep or None]  # the oldest beyond ``keep`` go back to the allocator
        lease = Lease(buffer[:numel], functools.partial(self.free.append, buffer))
        return torch.from_numpy(np.asarray(lease)).view(shape)


def _alike(value: torch.Tensor, rows: int, pin: bool, pool: Optional[Pool]) -> torch.Tensor:
    shape = (rows,) + tuple(value.shape[1:])
    if pool is not None and not pin and value.dtype == pool.dtype:  # the patches: nothing else is uint8
        return pool.empty(shape)
    return torch.empty(shape, dtype=value.dtype, pin_memory=pin)


def _fill(parts: List[Tuple[Dict, List[int]]], rows: int, pin: bool, pool: Optional[Pool]):
    first = parts[0][0]
    if isinstance(first, dict):
        return {key: _fill([(part[key], index) for part, index in parts], rows, pin, pool) for key in first}
    out = _alike(first, rows, pin, pool)
    for value, index in parts:
        _copy_rows(out, value, index)
    return out


def _copy_rows(out: torch.Tensor, value: torch.Tensor, index: List[int]) -> None:
    if value[0].numel() * value.element_size() >= BIG_ROW:
        for source, row in zip(value, index):
            out[row].copy_(source)
    else:
        out.index_copy_(0, torch.tensor(index, dtype=torch.long), value)


def _into(full: List[Tuple[Dict, Dict]], batch_size: int, pool: Optional[Pool], target: torch.Tensor) -> Dict:
    """The batch with ring buffer ``target`` as its patches: rows the workers wrote there stay, others copied in."""
    small = [({**part, "image": {k: v for k, v in part["image"].items() if k != "patches"}}, m["rows"])
             for part, m in full]
    batch = _fill(small, batch_size, False, pool)
    for part, m in full:
        if m.get("ring") is None:
            _copy_rows(target, part["image"]["patches"], m["rows"])
    batch["image"]["patches"] = target
    return batch


def assemble(parts: List[Tuple[Optional[Dict], Dict]], batch_size: int, pin: bool = False,
             pool: Optional[Pool] = None, target: Optional[torch.Tensor] = None,
             buffer: Optional[int] = None) -> Tuple[Dict, Dict]:
    """``(batch, meta)`` from one batch's ``(part, meta)`` pairs; ``meta`` sums the parts' counts and has each row's
    ``keys``. ``target``: the ring buffer the parts with ``meta["ring"]`` wrote their rows into."""
    full = [(part, meta) for part, meta in parts if part is not None]
    meta = {"index": parts[0][1]["index"], "samples": sum(m.get("samples", 0) for _, m in full),
            "image_tokens": sum(m.get("image_tokens", 0) for _, m in full),
            "corrupt": sum(m.get("corrupt", 0) for _, m in parts),
            "standins": sum(m.get("standins", 0) for _, m in parts),
            "messages": [text for _, m in parts for text in m.get("messages", ())]}
    if meta["samples"] != batch_size:
        raise RuntimeError(f"batch {meta['index']}: its parts hold {meta['samples']} of {batch_size} rows")
    keys = [None] * batch_size
    for _, m in full:
        for row, key in zip(m["rows"], m.get("keys", ())):
            keys[row] = key
    meta["keys"] = keys
    for _, m in full:
        if m.get("ring") is not None and (target is None or m["ring"] != buffer):
            raise RuntimeError(f"batch {meta['index']}: a worker wrote its rows into ring buffer {m['ring']}, "
                               f"which the loader did not assign to it")
    if target is not None and len(full) > 1 or any(m.get("ring") is not None for _, m in full):
        return _into(full, batch_size, pool, target), meta
    if len(full) == 1:
        return full[0][0], meta
    pin = pin and torch.cuda.is_available() and all(_pinned(part) for part, _ in full)
    return _fill([(part, m["rows"]) for part, m in full], batch_size, pin, pool), meta


def _pinned(part: Dict) -> bool:
    value = part["image"]["patches"]
    return value.is_pinned()
