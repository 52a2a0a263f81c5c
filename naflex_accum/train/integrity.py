"""A checkpoint's checksum: CRC-32 over every tensor's bytes and the payload's structure, per top-level key.

Invariant: a payload ``seal``ed before it is written and read back with other
bytes in any tensor, or another structure (a key, a shape, a dtype, a number),
fails ``changed_parts``, which names the top-level keys that differ
(``state_dict``, ``optimizer``, ...). A payload without a checksum (written
before checkpoints had one, or open_clip's and timm's files) is not checked.
Tensors are read where they lie: a CPU tensor's memory is hashed in place, no
copy of the model is made (a CUDA tensor is copied to the host one at a time).
A structure the checksum cannot walk (a checksum of another shape, a sparse
tensor, nesting deeper than Python's recursion, a container pickled once and
referenced 100,000 times over) raises ``Unverifiable``, never another error
and never an hour's walk.
"""
import zlib
from typing import List, Optional

import torch

CHECKSUM_KEY = "checksum"
ALGORITHM = "crc32-v1"  # another value (a later version's) is not checked
# A pickle stores a shared container once: a small file can reference one list 10**9 times. Our payloads share
# none; this many repeat visits ends the walk (under a second).
MAX_REPEATS = 100_000


class Unverifiable(ValueError):
    """The payload's structure cannot be checksummed (see the module docstring)."""


def _crc(value, crc: int = 0, seen: Optional[dict] = None) -> int:
    """``crc`` extended with ``value``: tensors by dtype, shape and bytes, containers item by item, in order
    (``seen``: the containers walked so far, and how many were walked again)."""
    seen = {"ids": set(), "repeats": 0} if seen is None else seen
    if isinstance(value, (dict, list, tuple)) and value:  # () is one object wherever it appears
        if id(value) in seen["ids"]:
            seen["repeats"] += 1
            if seen["repeats"] > MAX_REPEATS:
                raise Unverifiable(f"a container is referenced over {MAX_REPEATS:,} times")
        seen["ids"].add(id(value))
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
            crc = _crc(item, _crc(key, crc, seen), seen)
        return crc
    if isinstance(value, (list, tuple)):
        crc = zlib.crc32(f"{type(value).__name__}{len(value)}".encode(), crc)
        for item in value:
            crc = _crc(item, crc, seen)
        return crc
    return zlib.crc32(f"{type(value).__name__}:{value!r}".encode(), crc)  # numbers, strings, None


def _parts(payload: dict) -> dict:
    seen: dict = {"ids": set(), "repeats": 0}
    try:
        return {str(key): _crc(value, 0, seen) for key, value in payload.items() if key != CHECKSUM_KEY}
    except RecursionError:
        raise Unverifiable("nested deeper than Python's recursion limit") from None
    except RuntimeError as exc:  # a tensor whose bytes cannot be viewed (sparse, quantized)
        raise Unverifiable(f"a tensor's bytes cannot be read ({(str(exc).splitlines() or [''])[0][:120]})") \
            from None


def seal(payload: dict) -> dict:
    """``payload`` with its checksum added (a new dict; the tensors are shared, not copied)."""
    return {**payload, CHECKSUM_KEY: {"algorithm": ALGORITHM, "parts": _parts(payload)}}


def sealed(payload: dict) -> bool:
    """Whether ``payload`` carries a checksum this version verifies."""
    recorded = payload.get(CHECKSUM_KEY)
    return isinstance(recorded, dict) and recorded.get("algorithm") == ALGORITHM


def changed_parts(payload: dict) -> List[str]:
    """The top-level keys whose content differs from what the checksum recorded ([]: intact or not sealed;
    ``checksum`` itself when the record is not a table of numbers); ``Unverifiable`` as the module says."""
    if not sealed(payload):
        return []
    saved = payload[CHECKSUM_KEY].get("parts")
    if not isinstance(saved, dict) or not all(isinstance(k, str) and type(v) is int for k, v in saved.items()):
        return [CHECKSUM_KEY]  # what seal writes: {top-level key: CRC}
    now = _parts(payload)
    return sorted({str(key) for key in set(saved) | set(now) if saved.get(key) != now.get(key)})
