"""Image bytes -> uint8 RGB tensors: torchvision's decoders where they apply, Pillow for the rest.

Invariant: ``decode_rgb(data)`` is a uint8 ``[3, H, W]`` tensor, channels-last in memory, converted the same
way whichever decoder made it (EXIF orientation, alpha over white, 16-bit by the high byte; mode F and
out-of-range 32-bit refused). ``inspect`` reads the header alone (format, size, pixel limit, a stream cut short,
``ImageInfo.scalable``), so a resume's skip counts the same samples undecodable; ``peak_bytes`` bounds a
decode's memory from it. docs/data.md, "Decoding and image modes" and "Decode memory".
"""
import io
import sys
import warnings
from typing import NamedTuple

import numpy as np
import torch
from PIL import Image, ImageOps
from torchvision.io import ImageReadMode, decode_jpeg, decode_png, decode_webp

_JPEG, _PNG, _WEBP = "jpeg", "png", "webp"
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_WHITE = 255
_HIGH_BYTE = 1 if sys.byteorder == "little" else 0  # of a native uint16 sample
STRIP_PIXELS = 1 << 16  # pixels composited at once: int32 intermediates of a strip, never of the whole image
# Bytes a pixel Pillow's path may hold at once: its image (4 bytes a pixel for most modes), a converted copy, the
# bytes and the numpy array Pillow's array interface makes of that, and the result (measured: docs/data.md)
PILLOW_BYTES_PER_PIXEL = 18


class ImageInfo(NamedTuple):
    format: str        # "jpeg", "png", "webp" (torchvision decodes) or Pillow's format name
    height: int
    width: int
    alpha: bool = False
    bits16: bool = False
    torchvision: bool = True
    scalable: bool = False  # a JPEG that a DCT-scaled decode converts as decode_rgb does (``decode``)


def sniff(data: bytes):
    """The format torchvision decodes, from the signature: "jpeg", "png", "webp", or None."""
    if data[:3] == b"\xff\xd8\xff":
        return _JPEG
    if data[:8] == _PNG_SIGNATURE:
        return _PNG
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return _WEBP
    return None


def readable(data: bytes) -> bool:
    """Cheap read-time check: a JPEG/PNG/WebP signature, else Pillow can identify the file (raises if not)."""
    if sniff(data) is not None:
        return True
    with Image.open(io.BytesIO(data)):
        return True


def _be(b: bytes) -> int:
    return int.from_bytes(b, "big")


def _le(b: bytes) -> int:
    return int.from_bytes(b, "little")


def _exif_orientation(segment: bytes) -> int:
    """The orientation tag (1-8) of an APP1 Exif payload, 1 where it has none, 0 where it cannot be read."""
    tiff = segment[6:]
    order = {b"II": "little", b"MM": "big"}.get(tiff[:2])
    if order is None or len(tiff) < 8:
        return 0
    ifd = int.from_bytes(tiff[4:8], order)
    if ifd + 2 > len(tiff):
        return 0
    for k in range(int.from_bytes(tiff[ifd:ifd + 2], order)):
        entry = tiff[ifd + 2 + 12 * k:ifd + 14 + 12 * k]
        if len(entry) < 12:
            return 0
        if int.from_bytes(entry[:2], order) == 0x0112:
            value = int.from_bytes(entry[8:10], order)
            return value if 1 <= value <= 8 else 0
    return 1


def _jpeg(data: bytes) -> ImageInfo:
    pos, n, size, frame, orientations = 2, len(data), None, None, []
    while pos + 4 <= n:
        if data[pos] != 0xFF:
            raise ValueError(f"JPEG marker expected at byte {pos}")
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # markers without a length
            pos += 2
            continue
        length = data[pos + 2] << 8 | data[pos + 3]  # big-endian segment length
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):  # start of frame
            if pos + 10 > n:
                raise ValueError("JPEG data ends inside its frame header")
            size = (data[pos + 5] << 8 | data[pos + 6], data[pos + 7] << 8 | data[pos + 8])  # height, width
            frame = (marker, data[pos + 4], data[pos + 9])  # kind, bits per sample, components
        elif marker == 0xE1 and data[pos + 4:pos + 10] == b"Exif\x00\x00":
            orientations.append(_exif_orientation(data[pos + 4:pos + 2 + length]))
        elif marker == 0xDA:  # start of scan: entropy-coded data follows, which never holds FF D9
            if size is None or 0 in size:
                raise ValueError("JPEG without a frame size")
            if data.rfind(b"\xff\xd9", pos) < 0:
                raise ValueError("JPEG data ends early (no end-of-image marker)")
            # baseline, extended or progressive Huffman, 8-bit, grey or YCbCr/RGB, and upright: what a scaled
            # decode converts exactly as the full one (12-bit, CMYK, lossless, EXIF rotations go the full way)
            scalable = frame[0] in (0xC0, 0xC1, 0xC2) and frame[1] == 8 and frame[2] in (1, 3) \
                and orientations in ([], [1])
            return ImageInfo(_JPEG, *size, scalable=scalable)
        pos += 2 + length
    raise ValueError("JPEG data ends before its first scan")


def _png(data: bytes) -> ImageInfo:
    if data[12:16] != b"IHDR" or len(data) < 33:
        raise ValueError("PNG without a header chunk")
    width, height, depth, colour = _be(data[16:20]), _be(data[20:24]), data[24], data[25]
    alpha, key, pos, n = colour in (4, 6), False, 33, len(data)
    while pos + 8 <= n:  # walk the chunks: a tRNS chunk means transparency; no IEND means the file was cut
        kind = data[pos + 4:pos + 8]
        if kind == b"IEND":
            # torchvision ignores a grey or RGB colour key (tRNS outside a palette): Pillow applies it
            return ImageInfo(_PNG, height, width, alpha, depth == 16, torchvision=not key)
        if kind == b"tRNS":
            alpha, key = True, colour in (0, 2)
        pos += 12 + _be(data[pos:pos + 4])
    raise ValueError("PNG data ends early (no IEND chunk)")


def _webp(data: bytes) -> ImageInfo:
    if len(data) < _le(data[4:8]) + 8 or len(data) < 30:
        raise ValueError("WebP data ends early")
    kind = data[12:16]
    if kind == b"VP8 ":
        return ImageInfo(_WEBP, _le(data[28:30]) & 0x3FFF, _le(data[26:28]) & 0x3FFF)
    if kind == b"VP8L":
        bits = _le(data[21:25])
        return ImageInfo(_WEBP, 1 + ((bits >> 14) & 0x3FFF), 1 + (bits & 0x3FFF), bool(bits >> 28 & 1))
    if kind == b"VP8X":
        flags = data[20]
        # torchvision ignores EXIF orientation in WebP and reads no animation: Pillow takes those
        return ImageInfo(_WEBP, 1 + _le(data[27:30]), 1 + _le(data[24:27]), bool(flags & 0x10),
                         torchvision=not flags & 0x0A)
    raise ValueError(f"WebP with an unknown chunk {kind!r}")


def _check_pixels(info: ImageInfo) -> ImageInfo:
    limit = Image.MAX_IMAGE_PIXELS
    if limit and info.height * info.width > 2 * limit:  # where Pillow raises DecompressionBombError
        raise ValueError(f"{info.width}x{info.height} pixels is more than twice PIL.Image.MAX_IMAGE_PIXELS "
                         f"({limit}), a possible decompression bomb")
    return info


def inspect(data: bytes) -> ImageInfo:
    """Format, size and flags from the header; raises on a stream cut short or too many pixels."""
    fmt = sniff(data)
    if fmt is not None:
        return _check_pixels({_JPEG: _jpeg, _PNG: _png, _WEBP: _webp}[fmt](data))
    with Image.open(io.BytesIO(data)) as img:  # Pillow raises its own DecompressionBombError
        return ImageInfo(img.format or "unknown", img.height, img.width, torchvision=False)


def peak_bytes(info: ImageInfo) -> int:
    """About the most memory ``decode_rgb`` holds at once for ``info``'s image, from its header alone: the
    decoder's output, its one uint8 copy, Pillow's images, and half a byte a pixel for strips and resize rows."""
    pixels = info.height * info.width
    if not info.torchvision:
        per_pixel = PILLOW_BYTES_PER_PIXEL
    elif info.format == _JPEG:
        per_pixel = 3  # decode_jpeg converts grey, CMYK and YCCK to RGB as it goes
    else:
        per_pixel = (4 if info.alpha else 3) * (2 if info.bits16 else 1) + (3 if info.alpha or info.bits16 else 0)
        per_pixel += info.format == _WEBP and info.alpha  # libwebp's alpha plane
    return per_pixel * pixels + pixels // 2


def channels_last(img: torch.Tensor) -> torch.Tensor:
    """``[C, H, W]`` laid out ``[H, W, C]`` in memory (a no-op for torchvision's decoders' output)."""
    c, _, w = img.shape
    if img.stride() == (1, w * c, c):
        return img
    return img.permute(1, 2, 0).contiguous().permute(2, 0, 1)


def over_white(rgba: torch.Tensor) -> torch.Tensor:
    """uint8 ``[4, H, W]`` RGBA -> ``[3, H, W]`` RGB (channels-last) over white, rounded to nearest; in place,
    ``STRIP_PIXELS`` at a time, so the int32 arithmetic never spans the whole image."""
    _, h, w = rgba.shape
    out = torch.empty((h, w, 3), dtype=torch.uint8)
    rows = max(1, STRIP_PIXELS // max(1, w))
    for y in range(0, h, rows):
        strip = rgba[:, y:y + rows]
        alpha = strip[3:].to(torch.int32)
        mixed = strip[:3].to(torch.int32).mul_(alpha)
        mixed.add_(alpha.neg_().add_(255).mul_(_WHITE)).add_(127).div_(255, rounding_mode="floor")
        out[y:y + rows].copy_(mixed.permute(1, 2, 0))
    return out.permute(2, 0, 1)


def high_bytes(img: torch.Tensor) -> torch.Tensor:
    """uint16 ``[C, H, W]`` (channels-last, as torchvision decodes) -> a uint8 view of each high byte, no copy."""
    hwc = channels_last(img).permute(1, 2, 0)
    return hwc.view(torch.uint8)[..., _HIGH_BYTE::2].permute(2, 0, 1)


_quiet = False


def _as_tensor(data: bytes) -> torch.Tensor:
    global _quiet
    if _quiet:
        return torch.frombuffer(data, dtype=torch.uint8)
    # torch warns (once a process) that bytes are read-only; the decoders only read them.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        out = torch.frombuffer(data, dtype=torch.uint8)
    _quiet = True
    return out


def _torchvision(data: bytes, info: ImageInfo) -> torch.Tensor:
    raw = _as_tensor(data)
    mode = ImageReadMode.RGB_ALPHA if info.alpha else ImageReadMode.RGB
    if info.format == _JPEG:
        return decode_jpeg(raw, mode=mode, apply_exif_orientation=True)
    if info.format == _PNG:
        img = decode_png(raw, mode=mode, apply_exif_orientation=True)
        if info.bits16:
            img = high_bytes(img)
    else:
        img = decode_webp(raw, mode=mode)
    return over_white(img) if info.alpha else img


def _pillow(data: bytes) -> torch.Tensor:
    def tensor(array):  # HWC numpy -> CHW view of HWC memory
        return torch.from_numpy(array).permute(2, 0, 1)

    with Image.open(io.BytesIO(data)) as img:
        ImageOps.exif_transpose(img, in_place=True)
        mode, key = img.mode, img.info.get("transparency")
        if mode == "F":
            raise ValueError("a floating-point image (mode F) has no defined 8-bit scale")
        if mode.startswith("I"):  # I;16, I;16B, I;16L, I;16N, I: 16-bit (or 32-bit integer) grey
            grey = np.asarray(img)  # uint16, or int32 for mode I: shifted as it is, never widened
            wide = grey.dtype.kind != "u" or grey.dtype.itemsize > 2
            if grey.size and wide and (grey.min() < 0 or grey.max() > 0xFFFF):
                raise ValueError(f"a mode {mode} image with values outside 0..65535 has no defined 8-bit scale")
            planes = [(grey >> 8).astype(np.uint8)] * 3
            if key is None:
                return tensor(np.stack(planes, -1))
            return over_white(tensor(np.stack(planes + [np.where(grey == key, 0, 255).astype(np.uint8)], -1)))
        if "A" in mode or "a" in mode or key is not None:
            if mode in ("La", "RGBa"):
                img = img.convert(mode.upper())  # un-premultiply first
            return over_white(tensor(np.array(img.convert("RGBA"))))
        return tensor(np.array(img.convert("RGB")))


def decode_rgb(data: bytes, info: ImageInfo = None) -> torch.Tensor:
    """uint8 ``[3, H, W]`` (channels-last memory) of an encoded image, converted as the module docstring says."""
    info = inspect(data) if info is None else info
    if info.torchvision:
        try:
            return channels_last(_torchvision(data, info))  # EXIF rotations come back transposed
        except Exception:
            pass  # what torchvision refuses (12-bit JPEG, say), Pillow may still read; if not, it raises
    return channels_last(_pillow(data))
