"""A batch from the parts the loader workers of a rank built of it (``pipeline``).

Invariant: the assembled batch is row for row what one process reading every
slot of the rank would have built: row ``t`` is the part row that ``meta["rows"]``
places at ``t``, so a batch's rows, and so its losses and gradients, are the
same bit for bit whatever the number of workers. A batch built whole by one
part is passed on as it is (no copy); otherwise each part is copied once into
a new batch (pinned when the parts were, for CUDA).
"""
from typing import Dict, List, Optional, Tuple

import torch


def _alike(value: torch.Tensor, rows: int, pin: bool) -> torch.Tensor:
    return torch.empty((rows,) + tuple(value.shape[1:]), dtype=value.dtype, pin_memory=pin)


def _fill(parts: List[Tuple[Dict, torch.Tensor]], rows: int, pin: bool):
    first = parts[0][0]
    if isinstance(first, dict):
        return {key: _fill([(part[key], index) for part, index in parts], rows, pin) for key in first}
    out = _alike(first, rows, pin)
    for value, index in parts:
        out.index_copy_(0, index, value)
    return out


def assemble(parts: List[Tuple[Optional[Dict], Dict]], batch_size: int, pin: bool = False) -> Tuple[Dict, Dict]:
    """``(batch, meta)`` from one batch's ``(part, meta)`` pairs; ``meta`` sums the parts' counts and has
    ``keys``, each row's sample key (``url#key``)."""
    full = [(part, meta) for part, meta in parts if part is not None]
    meta = {"index": parts[0][1]["index"], "samples": sum(m.get("samples", 0) for _, m in full),
            "image_tokens": sum(m.get("image_tokens", 0) for _, m in full),
            "corrupt": sum(m.get("corrupt", 0) for _, m in parts),
            "messages": [text for _, m in parts for text in m.get("messages", ())]}
    if meta["samples"] != batch_size:
        raise RuntimeError(f"batch {meta['index']}: its parts hold {meta['samples']} of {batch_size} rows")
    keys = [None] * batch_size
    for _, m in full:
        for row, key in zip(m["rows"], m.get("keys", ())):
            keys[row] = key
    meta["keys"] = keys
    if len(full) == 1:
        return full[0][0], meta
    pin = pin and torch.cuda.is_available() and all(_pinned(part) for part, _ in full)
    indexed = [(part, torch.tensor(m["rows"], dtype=torch.long)) for part, m in full]
    return _fill(indexed, batch_size, pin), meta


def _pinned(part: Dict) -> bool:
    value = part["image"]["patches"]
    return value.is_pinned()
