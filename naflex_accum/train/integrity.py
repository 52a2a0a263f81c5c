"""A checkpoint's checksum: CRC-32 over every tensor's bytes and the payload's structure, per top-level key.

Invariant: a payload ``seal``ed before it is written and read back with other
bytes in any tensor, or another structure (a key, a shape, a dtype, a number),
fails ``changed_parts``, which names the top-level keys that differ
(``state_dict``, ``optimizer``, ...). A payload without a checksum (written
before checkpoints had one, or open_clip's and timm's files) is not checked.
Tensors are read where they lie: a CPU tensor's memory is hashed in place, no
copy of the model is made (a CUDA tensor is copied to the host one at a time).
"""
import zlib
from typing import List

import torch

CHECKSUM_KEY = "checksum"
ALGORITHM = "crc32-v1"  # another value (a later version's) is not checked


def _crc(value, crc: int = 0) -> int:
    """``crc`` extended with ``value``: tensors by dtype, shape and bytes, containers item by item, in order."""
    if isinstance(value, torch.Tensor):
        tensor = value.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        crc = zlib.crc32(f"T{tensor.dtype}{tuple(tensor.shape)}".encode(), crc)
        if tensor.numel():
            flat = tensor.contiguous().reshape(-1).view(torch.uint8)  # any dtype (bf16 included) as its bytes
            crc = zlib.crc32(memoryview(flat.numpy()), crc)
        return crc
    if isinstance(value, dict):
        crc = zlib.crc32(f"D{len(value)}".encode(), crc)
        for key, item in value.items():  # insertion order, which pickling keeps
            crc = _crc(item, _crc(key, crc))
        return crc
    if isinstance(value, (list, tuple)):
        crc = zlib.crc32(f"{type(value).__name__}{len(value)}".encode(), crc)
        for item in value:
            crc = _crc(item, crc)
        return crc
    return zlib.crc32(f"{type(value).__name__}:{value!r}".encode(), crc)  # numbers, strings, None


def _parts(payload: dict) -> dict:
    return {str(key): _crc(value) for key, value in payload.items() if key != CHECKSUM_KEY}


def seal(payload: dict) -> dict:
    """``payload`` with its checksum added (a new dict; the tensors are shared, not copied)."""
    return {**payload, CHECKSUM_KEY: {"algorithm": ALGORITHM, "parts": _parts(payload)}}


def sealed(payload: dict) -> bool:
    return isinstance(payload.get(CHECKSUM_KEY), dict)


def changed_parts(payload: dict) -> List[str]:
    """The top-level keys whose content differs from what the checksum recorded ([]: intact or not sealed)."""
    recorded = payload.get(CHECKSUM_KEY)
    if not isinstance(recorded, dict) or recorded.get("algorithm") != ALGORITHM:
        return []
    saved, now = recorded.get("parts") or {}, _parts(payload)
    return sorted(key for key in set(saved) | set(now) if saved.get(key) != now.get(key))
