"""Encoded image -> uint8 RGB at its NaFlex size, decoding a JPEG no larger than that size needs.

Invariant: ``decode_for_seq(data, seq_len, patch)`` has exactly the size ``resize_for_seq(decode_rgb(data), ...)``
has and fails where that fails; a ``scalable`` JPEG may be decoded DCT-reduced (simplejpeg, strict) first, and
``mode="full"`` is the full path bit for bit. No decode holds more than ``DECODE_BUDGET`` bytes (from
``images.peak_bytes``): over it, a reduced decode or ``ValueError``. docs/data.md, "Scaled JPEG decoding".
"""
import logging
from typing import Optional, Tuple

import torch
from torchvision.transforms import InterpolationMode
from torchvision.transforms.v2.functional import resize_image

from ..errors import UsageError
from .images import ImageInfo, decode_rgb, inspect, peak_bytes
from .patches import resize_for_seq, size_for_seq

log = logging.getLogger(__name__)

DECODE_MODES = ("scaled", "full")  # --image-decode
FACTORS = (8, 4, 2)  # libjpeg-turbo's DCT reductions whose IDCTs it vectorises; largest first
# Bytes one image's decode may hold at once, in each process that decodes (a loader worker, or the trainer with
# --workers 0): every 8-bit RGB JPEG, PNG or WebP under Pillow's pixel limit fits, a 16-bit RGBA PNG up to 93
# megapixels (a few MB of PNG can hold more), one of Pillow's formats up to 58 (docs/data.md "Decode memory")
DECODE_BUDGET = 1 << 30
_simplejpeg = None


def check_mode(mode: str, flag: str = "--image-decode") -> str:
    if mode not in DECODE_MODES:
        raise UsageError(f"{flag} {mode!r}: expected one of {', '.join(DECODE_MODES)}")
    return mode


def dct_factor(hw: Tuple[int, int], target: Tuple[int, int]) -> int:
    """The largest of 8, 4, 2 whose reduced decode (each side ``ceil(side / f)``) covers ``target``; else 1."""
    (h, w), (th, tw) = hw, target
    for f in FACTORS:
        if -(-h // f) >= th and -(-w // f) >= tw:
            return f
    return 1


def _decoder():
    global _simplejpeg
    if _simplejpeg is None:
        try:
            import simplejpeg  # a declared dependency, but a missing one must not stop a run
            _simplejpeg = simplejpeg
        except ImportError:  # a declared dependency; without it every JPEG takes the full path
            log.warning("simplejpeg is not installed: JPEGs are decoded at full size (pip install simplejpeg)")
            _simplejpeg = False
    return _simplejpeg


def scaled_jpeg(data: bytes, info: ImageInfo, factor: int) -> Optional[torch.Tensor]:
    """uint8 ``[3, ceil(H/f), ceil(W/f)]`` (channels-last) decoded at 1/``factor``; None where that path declines."""
    simplejpeg = _decoder()
    if not simplejpeg:
        return None
    h, w = -(-info.height // factor), -(-info.width // factor)
    try:  # strict: any libjpeg warning (bad restart marker, data cut short) raises, and the full path decides
        pixels = simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=h, min_width=w, strict=True)
    except Exception:
        return None
    if pixels.shape != (h, w, 3):
        return None
    return torch.from_numpy(pixels).permute(2, 0, 1)


def _reduced(info: ImageInfo, factor: int) -> ImageInfo:
    return info._replace(height=-(-info.height // factor), width=-(-info.width // factor))


def _within_budget(info: ImageInfo, factor: int) -> int:
    """The smallest DCT reduction, at least ``factor``, whose decode of ``info`` fits ``DECODE_BUDGET``; 0 if none."""
    return next((f for f in (1,) + FACTORS[::-1] if f >= factor and peak_bytes(_reduced(info, f)) <= DECODE_BUDGET), 0)


def over_budget(info: ImageInfo) -> str:
    """Why ``info``'s image is not decoded: what its decode would take against ``DECODE_BUDGET``."""
    kind = f"{'16-bit ' if info.bits16 else ''}{info.format.upper()}{' with alpha' if info.alpha else ''}"
    return (f"a {info.width}x{info.height} {kind} image takes about {peak_bytes(info) >> 20} MiB to decode, over "
            f"the {DECODE_BUDGET >> 20} MiB one decode may take (naflex_accum.data.decode.DECODE_BUDGET)")


def decode_for_seq(data: bytes, seq_len: int, patch_size: int, mode: str = "scaled",
                   info: Optional[ImageInfo] = None) -> torch.Tensor:
    """uint8 ``[3, h, w]``, ``(h, w) = size_for_seq`` of the full image: see the module docstring."""
    info = inspect(data) if info is None else info
    over = peak_bytes(info) > DECODE_BUDGET
    if info.scalable and (mode == "scaled" or over):
        target = size_for_seq((info.height, info.width), patch_size, seq_len)
        factor = dct_factor((info.height, info.width), target) if mode == "scaled" else 1
        factor = _within_budget(info, factor) if over else factor
        if factor > 1:
            pixels = scaled_jpeg(data, info, factor)
            if pixels is not None:
                if tuple(pixels.shape[-2:]) == target:
                    return pixels
                return resize_image(pixels, list(target), interpolation=InterpolationMode.BICUBIC, antialias=True)
    if over:
        raise ValueError(over_budget(info))
    return resize_for_seq(decode_rgb(data, info), seq_len, patch_size)
