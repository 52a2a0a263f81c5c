"""Decoding: every image mode converted one way by both decoders, the quality of the torchvision path against
Pillow's, the header check a resume relies on, the tar reader, the sizes and the tokenizer's fast path."""
import io
import random
import struct
import tarfile
import zlib

import numpy as np
import pytest
import torch
from data_common import demo, shard_paths, tar_members
from PIL import Image, ImageOps

from naflex_accum.data import images
from naflex_accum.data.tario import iter_tar

rng = np.random.default_rng(0)
RGB = (rng.random((24, 40, 3)) * 255).astype(np.uint8)
RGB[:, :12] = (200, 30, 60)  # a flat block: colour keys and palettes have something to match
ALPHA = (rng.random((24, 40)) * 255).astype(np.uint8)
GREY16 = (rng.random((24, 40)) * 65535).astype(np.uint16)


def encode(img, fmt, **kw) -> bytes:
    out = io.BytesIO()
    img.save(out, format=fmt, **kw)
    return out.getvalue()


def png16_rgb(array: np.ndarray) -> bytes:
    """A 16-bit RGB PNG (Pillow cannot write one)."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    h, w, _ = array.shape
    rows = b"".join(b"\0" + array[y].astype(">u2").tobytes() for y in range(h))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 16, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


def over_white(rgb, alpha):
    a = alpha.astype(np.int32)[..., None]
    return ((rgb.astype(np.int32) * a + 255 * (255 - a) + 127) // 255).astype(np.uint8)


def grey3(grey):
    return np.repeat(grey[..., None], 3, axis=-1)


def palette_image():
    return Image.fromarray(RGB).convert("P", palette=Image.ADAPTIVE, colors=16)


def _palette_expected(transparent=None):
    img = palette_image()
    rgb = np.asarray(img.convert("RGB"))
    if transparent is None:
        return rgb
    return over_white(rgb, np.where(np.asarray(img) == transparent, 0, 255).astype(np.uint8))


RGB16 = (rng.random((24, 40, 3)) * 65535).astype(np.uint16)
LOSSLESS = {  # name: (bytes, expected RGB computed from the source pixels, not by the code under test)
    "RGB png": (encode(Image.fromarray(RGB), "PNG"), RGB),
    "L png": (encode(Image.fromarray(RGB).convert("L"), "PNG"), grey3(np.asarray(Image.fromarray(RGB).convert("L")))),
    "1 png": (encode(Image.fromarray(RGB).convert("1"), "PNG"),
              grey3(np.asarray(Image.fromarray(RGB).convert("1")).astype(np.uint8) * 255)),
    "P png": (encode(palette_image(), "PNG"), _palette_expected()),
    "P with transparency png": (encode(palette_image(), "PNG", transparency=2), _palette_expected(2)),
    "RGBA png": (encode(Image.fromarray(np.dstack([RGB, ALPHA])), "PNG"), over_white(RGB, ALPHA)),
    "LA png": (encode(Image.fromarray(np.dstack([RGB, ALPHA])).convert("LA"), "PNG"),
               over_white(grey3(np.asarray(Image.fromarray(RGB).convert("L"))), ALPHA)),
    "I;16 png (16-bit grey)": (encode(Image.fromarray(GREY16), "PNG"), grey3((GREY16 >> 8).astype(np.uint8))),
    "16-bit RGB png": (png16_rgb(RGB16), (RGB16 >> 8).astype(np.uint8)),
    "RGB colour key png": (encode(Image.fromarray(RGB), "PNG", transparency=(200, 30, 60)),
                           over_white(RGB, np.where((RGB == (200, 30, 60)).all(-1), 0, 255).astype(np.uint8))),
    "RGBA webp (lossless)": (encode(Image.fromarray(np.dstack([RGB, ALPHA])), "WEBP", lossless=True),
                             over_white(RGB, ALPHA)),
    "GIF with transparency": (encode(palette_image(), "GIF", transparency=2), _palette_expected(2)),
    "BMP": (encode(Image.fromarray(RGB), "BMP"), RGB),
    "I;16 TIFF (16-bit grey)": (encode(Image.fromarray(GREY16), "TIFF"), grey3((GREY16 >> 8).astype(np.uint8))),
}


def check_layout(img):
    assert img.dtype == torch.uint8 and img.dim() == 3 and img.shape[0] == 3
    assert img.permute(1, 2, 0).is_contiguous()  # channels-last memory: the resize's fast path


@pytest.mark.parametrize("name", sorted(LOSSLESS))
def test_every_mode_converts_to_the_right_rgb(name):
    data, expected = LOSSLESS[name]
    out = images.decode_rgb(data)
    check_layout(out)
    assert np.array_equal(out.permute(1, 2, 0).numpy(), expected), name
    # the Pillow fallback converts the same way (on the formats torchvision reads, it is the other decoder)
    assert torch.equal(images.channels_last(images._pillow(data)), out)


def test_16_bit_is_scaled_not_clipped():
    out = images.decode_rgb(LOSSLESS["I;16 png (16-bit grey)"][0])
    clipped = np.asarray(Image.open(io.BytesIO(LOSSLESS["I;16 png (16-bit grey)"][0])).convert("RGB"))
    assert clipped.mean() > 240 and 100 < out.float().mean() < 155  # Pillow's convert is ~all white


@pytest.mark.parametrize("mode", ["RGB", "L", "CMYK"])
def test_jpeg_colour_spaces_match_pillow(mode):
    data = encode(Image.fromarray(RGB).convert(mode), "JPEG", quality=92)
    assert images.inspect(data).torchvision
    out = images.decode_rgb(data)
    check_layout(out)
    reference = np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).astype(int)
    assert np.abs(out.permute(1, 2, 0).numpy().astype(int) - reference).max() <= 1


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP"])
@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_is_applied(fmt, orientation):
    img = Image.fromarray(RGB)
    exif = img.getexif()
    exif[0x0112] = orientation
    data = encode(img, fmt, exif=exif.tobytes(), **({"lossless": True} if fmt == "WEBP" else {}))
    out = images.decode_rgb(data)
    check_layout(out)
    expected = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")).astype(int)
    assert out.shape[1:] == expected.shape[:2] == ((40, 24) if orientation >= 5 else (24, 40))
    assert np.abs(out.permute(1, 2, 0).numpy().astype(int) - expected).max() <= 1


def test_images_without_an_8_bit_scale_are_refused():
    with pytest.raises(ValueError, match="mode F"):
        images.decode_rgb(encode(Image.fromarray(rng.random((8, 8)).astype(np.float32)), "TIFF"))
    with pytest.raises(ValueError, match="outside 0..65535"):
        images.decode_rgb(encode(Image.fromarray(np.full((8, 8), 70000, np.int32)), "TIFF"))


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP"])
def test_cut_short_images_fail_the_header_check(fmt):
    # The check a resumed epoch runs on skipped samples must reject what the decode rejects.
    data = encode(Image.fromarray(RGB), fmt)
    assert images.inspect(data)[1:3] == (24, 40)
    for cut in (len(data) // 3, len(data) - 13):
        with pytest.raises(ValueError, match="ends"):
            images.inspect(data[:cut])
        with pytest.raises(Exception):
            images.decode_rgb(data[:cut])


def test_decompression_bombs_are_refused_from_the_header(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    for fmt in ("JPEG", "PNG"):
        with pytest.raises(ValueError, match="decompression bomb"):
            images.inspect(encode(Image.fromarray(RGB), fmt))


def test_readable_is_a_signature_check():
    assert images.readable(LOSSLESS["RGB png"][0]) and images.readable(LOSSLESS["BMP"][0])
    with pytest.raises(Exception):
        images.readable(b"this is not an image")


def textured(h, w, fmt, generator):
    """Smooth multi-scale noise, photo-like detail at every scale (the demo's flat shapes hide filter errors)."""
    import torch.nn.functional as F
    img = torch.zeros(3, h, w)
    for k in range(1, 7):
        noise = torch.rand(1, 3, max(2, h >> k), max(2, w >> k), generator=generator)
        img += F.interpolate(noise, size=(h, w), mode="bicubic", align_corners=False)[0] * 0.6 ** (6 - k)
    img = ((img - img.min()) / (img.max() - img.min()) * 255).byte().permute(1, 2, 0).numpy()
    return encode(Image.fromarray(img), fmt, **({"quality": 90} if fmt == "JPEG" else {}))


def test_torchvision_path_within_a_255th_of_pillow_on_demo_images(tmp_path):
    """Batches from the pipeline's decode/resize/collate vs Pillow's decode + bicubic resize (the reference)."""
    from naflex_accum.data.patches import IMAGE_STD, collate_images, resize_for_seq
    from pillow_reference import collate_uint8_patches, pil_to_patches

    blobs = [d for p in shard_paths(demo(tmp_path, num=64, val=0, shard_size=64).train)
             for n, d in tar_members(p) if n.endswith((".jpg", ".png"))]
    generator = torch.Generator().manual_seed(0)
    blobs += [textured(h, w, f, generator) for h, w, f in ((300, 200, "JPEG"), (97, 411, "PNG"), (512, 512, "JPEG"))]
    std = torch.tensor(IMAGE_STD).repeat(16 * 16)
    worst = 0.0
    for seq_len in (16, 64, 144):
        ours = collate_images([resize_for_seq(images.decode_rgb(b), seq_len) for b in blobs], seq_len)
        ref = collate_uint8_patches([pil_to_patches(Image.open(io.BytesIO(b)), seq_len) for b in blobs], seq_len)
        assert torch.equal(ours["patch_valid"], ref["patch_valid"])
        assert torch.equal(ours["patch_coord"], ref["patch_coord"])
        pixels = (ours["patches"] - ref["patches"]).abs() * std * 255  # back to 0..255 units
        per_image = pixels.sum((1, 2)) / (ours["patch_valid"].sum(1) * pixels.shape[-1])
        worst = max(worst, float(per_image.max()))
    assert worst < 1.0, f"an image differs from Pillow's by {worst:.2f}/255 on average"


# --- the tar reader ---------------------------------------------------------------------------------------


def _tar(fmt, compression=""):
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode=f"w:{compression}", format=fmt) as tar:
        members = [("a.jpg", b"x" * 700), ("d" * 120 + "/long.txt", b"long"), ("p" * 90 + "/" + "q" * 90 + ".txt",
                   b"prefix"), ("__key__", b"meta"), ("naïve.txt", "ü".encode()), ("empty.txt", b""),
                   ("big.bin", bytes(range(256)) * 40)]
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for kind, name in ((tarfile.DIRTYPE, "dir"), (tarfile.SYMTYPE, "link.jpg")):
            info = tarfile.TarInfo(name)
            info.type, info.linkname = kind, "a.jpg"
            tar.addfile(info)
        info = tarfile.TarInfo("last.txt")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"end"))
    return out.getvalue()


def _reference(blob):
    from webdataset.tariterators import tar_file_iterator
    return [(item["fname"], item["data"]) for item in tar_file_iterator(io.BytesIO(blob))]


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
@pytest.mark.parametrize("compression", ["", "gz"])
def test_tar_reader_yields_what_webdataset_yields(fmt, compression):
    blob = _tar(fmt, compression)
    got = list(iter_tar(io.BytesIO(blob)))
    assert got == _reference(blob)
    assert [n for n, _ in got][-1] == "last.txt" and "__key__" not in dict(got) and "dir" not in dict(got)


def test_tar_reader_raises_after_the_members_before_the_damage():
    blob = _tar(tarfile.PAX_FORMAT)
    good = list(iter_tar(io.BytesIO(blob)))
    for cut in (300, 2000, len(blob) // 2):
        got = []
        with pytest.raises(tarfile.ReadError):
            for item in iter_tar(io.BytesIO(blob[:cut])):
                got.append(item)
        assert got == good[:len(got)]
    corrupt = bytearray(blob)
    corrupt[100] ^= 0x55  # a flipped bit in the first header
    for bad in (bytes(corrupt), b"junk" * 300, b""):
        with pytest.raises(tarfile.ReadError):
            list(iter_tar(io.BytesIO(bad)))


# --- sizes and tokens -------------------------------------------------------------------------------------


def test_size_for_seq_is_timms():
    from timm.data.naflex_transforms import get_image_size_for_seq

    from naflex_accum.data.patches import size_for_seq
    r = random.Random(0)
    cases = [((r.randint(1, 3000), r.randint(1, 3000)), r.choice((8, 14, 16, 32)), r.choice((1, 16, 36, 64, 256, 576)))
             for _ in range(3000)] + [((h, w), 16, s) for h in range(1, 48, 3) for w in range(1, 48, 3) for s in (1, 4)]
    for hw, p, s in cases:
        assert size_for_seq(hw, p, s) == tuple(get_image_size_for_seq(hw, p, s)[1]), (hw, p, s)


@pytest.mark.parametrize("context_length", [77, 12])
def test_batch_tokenizer_gives_the_tokenizers_ids(tmp_path, context_length):
    import string

    from open_clip.tokenizer import SimpleTokenizer

    from naflex_accum.data.text import BatchTokenizer
    captions = [d.decode() for p in shard_paths(demo(tmp_path, num=32, val=0).train)
                for n, d in tar_members(p) if n.endswith(".txt")]
    r = random.Random(0)
    alphabet = string.printable + "éü—“”&;<>#\u00a0\u2028ﬁＡ\x1b"
    captions += ["".join(r.choice(alphabet) for _ in range(r.randint(0, 90))) for _ in range(400)]
    captions += ["", "   ", "&amp; Co", "<start_of_text> x", "It's DON'T 12.5%", "a " * 100]
    tokenizer = SimpleTokenizer(context_length=context_length)
    fast = BatchTokenizer(tokenizer)
    assert fast._fast_path()
    expected = tokenizer(captions)
    assert torch.equal(fast(captions), expected) and torch.equal(fast(captions), expected)  # cold and warm cache
    other = BatchTokenizer(lambda texts: [[len(t)] for t in texts])
    assert not other._fast_path() and torch.equal(other(["ab", "c"]), torch.tensor([[2], [1]]))
