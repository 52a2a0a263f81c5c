"""Encoded image -> uint8 RGB at its NaFlex size, decoding a JPEG no larger than that size needs.

Invariant: ``decode_for_seq(data, seq_len, patch)`` has exactly the size
``resize_for_seq(decode_rgb(data), seq_len, patch)`` has (the NaFlex target of the
full image, ``naflex.size_for_seq``), converted as ``images`` says, and fails where
that fails. Only how a JPEG becomes the target differs: where libjpeg-turbo's
DCT scaling by 1/2, 1/4 or 1/8 still leaves every side at or above the target,
the largest such reduction is decoded (simplejpeg), then resized to the target
with the same bicubic as ever. That path is taken only for what it decodes as
``decode_rgb`` would (``ImageInfo.scalable``: 8-bit grey or colour, baseline or
progressive, no EXIF rotation) and only when libjpeg reports nothing wrong
(simplejpeg's ``strict``): a warning, a 12-bit or CMYK file, a rotation, a size
that is not the expected one, or no simplejpeg at all goes the full way, which
decides, as before, whether the image decodes or is counted undecodable. A full
decode is never done twice, and at scale 1 the result is the full path's bit
for bit (``mode="full"`` always takes it). How far the scaled pixels move from
the full path's is measured in ``benchmarks/bench_data.py --photos``.
"""
import logging
from typing import Optional, Tuple

import torch

from ..errors import UsageError
from .images import ImageInfo, decode_rgb, inspect
from .patches import resize_for_seq, size_for_seq

log = logging.getLogger(__name__)

DECODE_MODES = ("scaled", "full")  # --image-decode
FACTORS = (8, 4, 2)  # libjpeg-turbo's DCT reductions whose IDCTs it vectorises; largest first
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
            import simplejpeg
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


def decode_for_seq(data: bytes, seq_len: int, patch_size: int, mode: str = "scaled",
                   info: Optional[ImageInfo] = None) -> torch.Tensor:
    """uint8 ``[3, h, w]``, ``(h, w) = size_for_seq`` of the full image: see the module docstring."""
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms.v2.functional import resize_image

    info = inspect(data) if info is None else info
    if mode == "scaled" and info.scalable:
        target = size_for_seq((info.height, info.width), patch_size, seq_len)
        factor = dct_factor((info.height, info.width), target)
        if factor > 1:
            pixels = scaled_jpeg(data, info, factor)
            if pixels is not None:
                if tuple(pixels.shape[-2:]) == target:
                    return pixels
                return resize_image(pixels, list(target), interpolation=InterpolationMode.BICUBIC, antialias=True)
    return resize_for_seq(decode_rgb(data, info), seq_len, patch_size)
