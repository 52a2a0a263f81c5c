"""Decode memory: bounded in bytes from the header (``images.peak_bytes``, ``decode.DECODE_BUDGET``).

The real thing in fresh processes, their peak resident memory read from ``/proc/self/status``
(``VmHWM``, reset first): PNG bombs under Pillow's pixel limit (13000 x 13000 RGBA, 16-bit
and 8-bit, a few MB each) stay within the budget plus a margin, and each decode path stays
within its own estimate (with the budget out of the way). Each image is decoded in its own
fork of one process that imported torch and the decoders once (``decoder``): a new process's
memory and allocator, without importing torch per image. In-process: an image over the
budget is decoded reduced where it can be (a JPEG), else refused in one line.
"""


import select
import struct
import subprocess
import sys
import zlib

import pytest
from longrun_common import SUBPROCESS_ENV
from PIL import Image
from unit.data.test_memory import _chunk, image  # noqa: F401 (fixtures)

MIB = 1 << 20

# A process that imported torch and the decoders, then for each "PATH BUDGET" line on stdin decodes PATH in a fresh
# fork of itself and prints its peak memory growth over the decode, in bytes, and the outcome ("failed" if it died).
PEAK = r"""
import os
import sys
import traceback
import torch
torch.set_num_threads(1)
from naflex_accum.data import decode

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))

def measure(path, budget):
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
    print(status("VmHWM") - base, outcome, flush=True)

for line in sys.stdin:
    path, budget = line.rstrip("\n").rsplit(" ", 1)
    pid = os.fork()
    if pid == 0:
        try:
            measure(path, int(budget))
            code = 0
        except BaseException:
            traceback.print_exc()
            code = 1
        os._exit(code)
    if os.waitpid(pid, 0)[1] != 0:
        print("failed", flush=True)
"""


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    """The process that forks one child per decode (``PEAK``), and the file its errors go to."""
    errors = tmp_path_factory.mktemp("decoder") / "stderr.txt"
    with open(errors, "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", PEAK], env=SUBPROCESS_ENV, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=err, text=True)
    yield proc, errors
    proc.stdin.close()
    proc.wait(timeout=60)


def png_bomb(side: int, bits16: bool) -> bytes:
    """A side x side RGBA PNG of one half-transparent colour, its rows streamed through zlib: a few MB."""
    pixel = bytes([200, 0, 100, 0, 50, 0, 128, 0]) if bits16 else bytes([200, 100, 50, 128])
    row, z = b"\0" + pixel * side, zlib.compressobj(1)
    idat = b"".join(z.compress(row) for _ in range(side)) + z.flush()
    header = struct.pack(">IIBBBBB", side, side, 16 if bits16 else 8, 6, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")


def peak(decoder, path, budget: int = 0):
    proc, errors = decoder
    proc.stdin.write(f"{path} {budget}\n")
    proc.stdin.flush()
    ready, _, _ = select.select([proc.stdout], [], [], 300)
    line = proc.stdout.readline().strip() if ready else "timed out"
    assert line not in ("failed", "timed out", ""), f"{line}: {errors.read_text()[-3000:]}"
    grown, outcome = line.split(" ", 1)
    return int(grown), outcome


@pytest.mark.parametrize("bits16", [True, False], ids=["16-bit", "8-bit"])
def test_a_png_bomb_under_the_pixel_limit_stays_within_the_decode_budget(decoder, tmp_path, bits16):
    """Red before: 6.3 / 5.7 GiB (int32 copies of the whole image) and 26 / 17 s, then decoded."""
    from naflex_accum.data.decode import DECODE_BUDGET

    path = tmp_path / "bomb.png"
    path.write_bytes(png_bomb(13000, bits16))
    (tmp_path / "bomb.png.small").write_bytes(png_bomb(64, bits16))
    assert 13000 * 13000 <= 2 * Image.MAX_IMAGE_PIXELS and path.stat().st_size < 10 * MIB  # under the bomb limit
    grown, outcome = peak(decoder, path)
    print(f"{'16' if bits16 else '8'}-bit RGBA 13000x13000 PNG ({path.stat().st_size / MIB:.1f} MB): peak grew "
          f"{grown / MIB:.0f} MiB; {outcome}")
    assert grown < DECODE_BUDGET + 256 * MIB, outcome
    assert outcome.startswith("refused: a 13000x13000 ") and "over the 1024 MiB one decode may take" in outcome

KINDS = ("16-bit RGBA PNG", "16-bit RGB PNG", "RGBA PNG", "JPEG", "RGBA WebP", "RGBA TIFF", "colour-key PNG")


@pytest.mark.parametrize("kind", KINDS)
def test_each_decode_path_stays_within_its_estimate(decoder, tmp_path, kind):
    """Red before: no estimate; the 16-bit and alpha paths took 3-4 times the bytes they take now."""
    from naflex_accum.data import images

    path = tmp_path / "image"
    path.write_bytes(image(kind, 3000, 4000))
    (tmp_path / "image.small").write_bytes(image(kind, 64, 64))
    estimate = images.peak_bytes(images.inspect(path.read_bytes()))
    grown, outcome = peak(decoder, path, budget=1 << 40)
    print(f"{kind} 4000x3000: peak grew {grown / MIB:.1f} MiB, estimate {estimate / MIB:.1f} MiB; {outcome}")
    assert outcome.startswith("decoded")
    assert grown <= estimate + 8 * MIB
