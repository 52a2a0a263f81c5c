"""Decode memory: bounded in bytes from the header (``images.peak_bytes``, ``decode.DECODE_BUDGET``).

The real thing in subprocesses, their peak resident memory read from ``/proc/self/status``
(``VmHWM``, reset first): PNG bombs under Pillow's pixel limit (13000 x 13000 RGBA, 16-bit
and 8-bit, a few MB each) stay within the budget plus a margin, and each decode path stays
within its own estimate (with the budget out of the way). In-process: an image over the
budget is decoded reduced where it can be (a JPEG), else refused in one line.
"""

import io
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png16(array: np.ndarray, colour: int) -> bytes:
    h, w = array.shape[:2]
    rows = b"".join(b"\0" + array[y].astype(">u2").tobytes() for y in range(h))
    header = struct.pack(">IIBBBBB", w, h, 16, colour, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(rows, 1)) \
        + _chunk(b"IEND", b"")


def image(kind: str, h: int, w: int) -> bytes:
    """A smooth (compressible, not flat) ``h x w`` image of ``kind``, encoded."""
    small = (np.random.default_rng(0).random((max(1, h // 8), max(1, w // 8), 4)) * 255).astype(np.uint8)
    rgba = np.asarray(Image.fromarray(small).resize((w, h)))
    if kind == "16-bit RGBA PNG":
        return png16(rgba.astype(np.uint16) * 257, 6)
    if kind == "16-bit RGB PNG":
        return png16(rgba[..., :3].astype(np.uint16) * 257, 2)
    out = io.BytesIO()
    pillow = {"RGBA PNG": (rgba, "PNG", {"compress_level": 1}), "JPEG": (rgba[..., :3], "JPEG", {"quality": 90}),
              "RGBA WebP": (rgba, "WEBP", {"lossless": True, "method": 0}), "RGBA TIFF": (rgba, "TIFF", {}),
              "colour-key PNG": (rgba[..., :3], "PNG", {"transparency": (1, 2, 3), "compress_level": 1})}
    array, fmt, options = pillow[kind]
    Image.fromarray(array).save(out, fmt, **options)
    return out.getvalue()


def test_over_the_budget_a_jpeg_is_decoded_reduced_and_other_images_are_refused(monkeypatch):
    """Red before: no budget."""
    from naflex_accum.data import decode, images
    from naflex_accum.data.patches import size_for_seq

    jpeg, png = image("JPEG", 1200, 1600), image("RGBA PNG", 1200, 1600)
    budget = images.peak_bytes(images.inspect(jpeg)) // 10  # 1/4 of each side fits, 1/2 does not
    monkeypatch.setattr(decode, "DECODE_BUDGET", budget)
    for mode in decode.DECODE_MODES:  # over the budget, "full" decodes reduced too: a reduced image beats none
        out = decode.decode_for_seq(jpeg, 1024, 16, mode)
        assert tuple(out.shape) == (3,) + size_for_seq((1200, 1600), 16, 1024)
    with pytest.raises(ValueError, match=r"a 1600x1200 PNG with alpha image takes about \d+ MiB to decode, "
                                         r"over the 0 MiB one decode may take \(naflex_accum.data.decode"):
        decode.decode_for_seq(png, 256, 16)
    assert decode._within_budget(images.inspect(jpeg), 1) == 4


def test_16_bit_and_alpha_decodes_keep_their_pixels():
    """The high-byte view and the strip-wise compositing give what the whole-image int32 arithmetic gave."""
    from naflex_accum.data import images

    rng = np.random.default_rng(1)
    rgba16 = rng.integers(0, 65536, (500, 300, 4), dtype=np.uint16)  # strips of 218 rows: a partial last one
    out = images.decode_rgb(png16(rgba16, 6))
    high = (rgba16 >> 8).astype(np.int32)
    alpha = high[..., 3:]
    expected = ((high[..., :3] * alpha + 255 * (255 - alpha) + 127) // 255).astype(np.uint8)
    assert np.array_equal(out.permute(1, 2, 0).numpy(), expected)
    rgb = images.decode_rgb(png16(rgba16[..., :3], 2))
    assert np.array_equal(rgb.permute(1, 2, 0).numpy(), (rgba16[..., :3] >> 8).astype(np.uint8))
    assert rgb.permute(1, 2, 0).is_contiguous()
    wide = torch.from_numpy(rng.integers(0, 256, (3, 70000, 4), dtype=np.uint8)).permute(2, 0, 1)
    a = wide[3:].to(torch.int32)
    whole = ((wide[:3].to(torch.int32) * a + 255 * (255 - a) + 127) // 255).to(torch.uint8)
    assert torch.equal(images.over_white(wide), whole)  # a strip narrower than a row: one row at a time
