"""Decode memory: bounded in bytes from the header (``images.peak_bytes``, ``decode.DECODE_BUDGET``).

The real thing in subprocesses, their peak resident memory read from ``/proc/self/status``
(``VmHWM``, reset first): PNG bombs under Pillow's pixel limit (13000 x 13000 RGBA, 16-bit
and 8-bit, a few MB each) stay within the budget plus a margin, and each decode path stays
within its own estimate (with the budget out of the way). In-process: an image over the
budget is decoded reduced where it can be (a JPEG), else refused in one line.
"""


import struct
import subprocess
import sys
import zlib

import pytest
from longrun_common import SUBPROCESS_ENV
from PIL import Image
from unit.data.test_memory import _chunk, image  # noqa: F401 (fixtures)

MIB = 1 << 20

# What a subprocess decoding one file reports: its peak memory growth over the decode, in bytes, and the outcome.
PEAK = r"""
import sys
import torch
torch.set_num_threads(1)
from naflex_accum.data import decode

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))

path, budget = sys.argv[1], int(sys.argv[2])
if budget:
    decode.DECODE_BUDGET = budget
with open(path + ".small", "rb") as f:
    decode.decode_for_seq(f.read(), 256, 16, "full")  # the decoders' libraries loaded
with open(path, "rb") as f:
    data = f.read()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak (VmHWM) starts again from here
base = status("VmRSS")
try:
    out = decode.decode_for_seq(data, 256, 16, "full")
    outcome = f"decoded {tuple(out.shape)}"
except ValueError as exc:
    outcome = f"refused: {exc}"
print(status("VmHWM") - base, outcome)
"""


def png_bomb(side: int, bits16: bool) -> bytes:
    """A side x side RGBA PNG of one half-transparent colour, its rows streamed through zlib: a few MB."""
    pixel = bytes([200, 0, 100, 0, 50, 0, 128, 0]) if bits16 else bytes([200, 100, 50, 128])
    row, z = b"\0" + pixel * side, zlib.compressobj(1)
    idat = b"".join(z.compress(row) for _ in range(side)) + z.flush()
    header = struct.pack(">IIBBBBB", side, side, 16 if bits16 else 8, 6, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")


def peak(path, budget: int = 0):
    done = subprocess.run([sys.executable, "-c", PEAK, str(path), str(budget)], env=SUBPROCESS_ENV,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    grown, outcome = done.stdout.strip().split(" ", 1)
    return int(grown), outcome


@pytest.mark.parametrize("bits16", [True, False], ids=["16-bit", "8-bit"])
def test_a_png_bomb_under_the_pixel_limit_stays_within_the_decode_budget(tmp_path, bits16):
    """Red before: 6.3 / 5.7 GiB (int32 copies of the whole image) and 26 / 17 s, then decoded."""
    from naflex_accum.data.decode import DECODE_BUDGET

    path = tmp_path / "bomb.png"
    path.write_bytes(png_bomb(13000, bits16))
    (tmp_path / "bomb.png.small").write_bytes(png_bomb(64, bits16))
    assert 13000 * 13000 <= 2 * Image.MAX_IMAGE_PIXELS and path.stat().st_size < 10 * MIB  # under the bomb limit
    grown, outcome = peak(path)
    print(f"{'16' if bits16 else '8'}-bit RGBA 13000x13000 PNG ({path.stat().st_size / MIB:.1f} MB): peak grew "
          f"{grown / MIB:.0f} MiB; {outcome}")
    assert grown < DECODE_BUDGET + 256 * MIB, outcome
    assert outcome.startswith("refused: a 13000x13000 ") and "over the 1024 MiB one decode may take" in outcome

KINDS = ("16-bit RGBA PNG", "16-bit RGB PNG", "RGBA PNG", "JPEG", "RGBA WebP", "RGBA TIFF", "colour-key PNG")


@pytest.mark.parametrize("kind", KINDS)
def test_each_decode_path_stays_within_its_estimate(tmp_path, kind):
    """Red before: no estimate; the 16-bit and alpha paths took 3-4 times the bytes they take now."""
    from naflex_accum.data import images

    path = tmp_path / "image"
    path.write_bytes(image(kind, 3000, 4000))
    (tmp_path / "image.small").write_bytes(image(kind, 64, 64))
    estimate = images.peak_bytes(images.inspect(path.read_bytes()))
    grown, outcome = peak(path, budget=1 << 40)
    print(f"{kind} 4000x3000: peak grew {grown / MIB:.1f} MiB, estimate {estimate / MIB:.1f} MiB; {outcome}")
    assert outcome.startswith("decoded")
    assert grown <= estimate + 8 * MIB
