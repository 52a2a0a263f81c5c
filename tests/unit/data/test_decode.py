"""The DCT-scaled decode (``data.decode``): the NaFlex size never changes, the pixels stay close to a full decode
+ resize on photo-like images, and every file the scaled path cannot decode exactly as the full path goes the full
path, so it decodes, or fails, exactly as before."""
import io
import struct

import numpy as np
import pytest
import torch
from PIL import Image

from naflex_accum.data import decode, images
from naflex_accum.data.patches import collate_images, resize_for_seq, size_for_seq
from naflex_accum.errors import UsageError

pytest.importorskip("simplejpeg")


def encode(img, fmt="JPEG", **kw) -> bytes:
    out = io.BytesIO()
    img.save(out, format=fmt, **kw)
    return out.getvalue()


def photo(h, w, seed=0, mode="RGB"):
    """Photo-like content: smooth multi-scale texture, hard edges and sensor-like noise."""
    import torch.nn.functional as F
    g = torch.Generator().manual_seed(seed)
    img = torch.zeros(3, h, w)
    for k in range(1, 8):
        noise = torch.rand(1, 3, max(2, h >> k), max(2, w >> k), generator=g)
        img += F.interpolate(noise, size=(h, w), mode="bicubic", align_corners=False)[0] * 0.6 ** (7 - k)
    img = (img - img.min()) / (img.max() - img.min())
    y0, x0 = int(torch.randint(0, h // 2, (1,), generator=g)), int(torch.randint(0, w // 2, (1,), generator=g))
    img[:, y0:y0 + h // 3, x0:x0 + w // 3] = torch.rand(3, 1, 1, generator=g)  # an object with hard edges
    img = (img + 0.02 * torch.randn(3, h, w, generator=g)).clamp(0, 1)
    return Image.fromarray((img * 255).byte().permute(1, 2, 0).numpy()).convert(mode)


def full_path(data, seq_len, patch=16):
    return resize_for_seq(images.decode_rgb(data), seq_len, patch)


def same_as_full_path(data, seq_len, patch=16):
    """``decode_for_seq`` (scaled) did what the full path does: the same pixels, or the same exception type."""
    try:
        expected = full_path(data, seq_len, patch)
    except Exception as exc:
        with pytest.raises(type(exc)):
            decode.decode_for_seq(data, seq_len, patch)
        return "fails"
    assert torch.equal(decode.decode_for_seq(data, seq_len, patch), expected)
    return "decodes"


def test_dct_factor_is_the_largest_reduction_that_covers_the_target():
    assert decode.dct_factor((1024, 768), (128, 96)) == 8
    assert decode.dct_factor((1024, 768), (129, 96)) == 4  # 1/8 gives 128 rows: one short
    assert decode.dct_factor((1023, 767), (128, 96)) == 8  # libjpeg rounds a reduced side up
    assert decode.dct_factor((500, 300), (250, 150)) == 2
    assert decode.dct_factor((500, 300), (256, 144)) == 1
    assert decode.dct_factor((64, 64), (128, 128)) == 1  # upscaling: always the full decode


SIZES = [(512, 768), (1024, 384), (700, 1000), (397, 611), (384, 384)]


@pytest.mark.parametrize("seq_len", [64, 256, 576])
def test_scaled_decode_keeps_the_size_and_stays_close_to_the_full_path(seq_len):
    """Same NaFlex size as the full path for every image, PSNR >= 30 dB, the normalised patches' per-channel
    mean within 0.01 and spread within 1% (the tolerance ``bench_data.py --photos`` checks on real photos)."""
    blobs = [encode(photo(h, w, seed), quality=75 + 5 * seed, subsampling=2) for seed, (h, w) in enumerate(SIZES)]
    scaled, full, reduced = [], [], 0
    for blob in blobs:
        s, f = decode.decode_for_seq(blob, seq_len, 16), full_path(blob, seq_len)
        assert s.shape == f.shape and s.dtype == torch.uint8
        h, w = images.inspect(blob)[1:3]
        assert tuple(s.shape[1:]) == size_for_seq((h, w), 16, seq_len)
        reduced += decode.dct_factor((h, w), tuple(s.shape[1:])) > 1
        scaled.append(s)
        full.append(f)
    assert reduced >= (1 if seq_len == 576 else 3)  # the scaled path ran (at 576 only the largest reduce)
    mse = np.mean([((a.double() - b.double()) ** 2).mean().item() for a, b in zip(scaled, full)])
    assert 10 * np.log10(255 ** 2 / mse) >= 30.0
    stats = []
    for batch in (scaled, full):
        patches = collate_images(batch, seq_len, 16)
        x = patches["patches"][patches["patch_valid"]].view(-1, 16 * 16, 3).reshape(-1, 3).double()
        stats.append((x.mean(0), x.std(0)))
    (m_s, s_s), (m_f, s_f) = stats
    assert (m_s - m_f).abs().max() <= 0.01
    assert ((s_s - s_f).abs() / s_f).max() <= 0.01


def test_at_full_scale_the_result_is_the_full_path_bit_for_bit():
    blob = encode(photo(300, 200), quality=90)
    for seq_len in (256, 1024):  # targets that no reduction covers
        assert decode.dct_factor((300, 200), size_for_seq((300, 200), 16, seq_len)) == 1
        assert torch.equal(decode.decode_for_seq(blob, seq_len, 16), full_path(blob, seq_len))


@pytest.mark.parametrize("mode", ["RGB", "L"])
def test_simplejpeg_decodes_what_torchvision_does(mode):
    """At 1/1 simplejpeg's libjpeg-turbo gives torchvision's pixels: only the DCT scale differs between the paths."""
    import simplejpeg
    blob = encode(photo(240, 320, mode=mode), quality=85)
    ours = torch.from_numpy(simplejpeg.decode_jpeg(blob, colorspace="RGB")).permute(2, 0, 1)
    assert torch.equal(ours, images.decode_rgb(blob))


def test_full_mode_is_the_full_path():
    blob = encode(photo(768, 512), quality=90)
    assert torch.equal(decode.decode_for_seq(blob, 64, 16, "full"), full_path(blob, 64))
    assert not torch.equal(decode.decode_for_seq(blob, 64, 16, "scaled"), full_path(blob, 64))


# --- what the scaled path must not decode differently ---------------------------------------------------


def jpeg12(h=64, w=64) -> bytes:
    """A valid 12-bit extended-sequential grey JPEG, flat mid grey (Pillow cannot write one): every block's DC
    difference and its AC run are the one-symbol Huffman codes '0' (category 0, then end of block)."""
    def seg(marker, payload):
        return b"\xff" + bytes([marker]) + struct.pack(">H", len(payload) + 2) + payload
    dqt = seg(0xDB, b"\x00" + bytes([1] * 64))
    sof = seg(0xC1, struct.pack(">BHHB", 12, h, w, 1) + b"\x01\x11\x00")
    dht = seg(0xC4, b"\x00" + bytes([1] + [0] * 15) + b"\x00" + b"\x10" + bytes([1] + [0] * 15) + b"\x00")
    sos = seg(0xDA, b"\x01\x01\x00\x00\x3f\x00")
    bits = "00" * ((h // 8) * (w // 8))
    bits += "1" * (-len(bits) % 8)
    scan = bytes(int(bits[i:i + 8], 2) for i in range(0, len(bits), 8))
    return b"\xff\xd8" + dqt + sof + dht + sos + scan + b"\xff\xd9"


def with_exif(img, orientation, **kw) -> bytes:
    exif = img.getexif()
    exif[0x0112] = orientation
    return encode(img, exif=exif.tobytes(), **kw)


def cut_mid_scan(blob: bytes, keep_end: bool) -> bytes:
    cut = blob[:len(blob) * 2 // 3]
    return cut + b"\xff\xd9" if keep_end else cut


def bad_restart(blob: bytes) -> bytes:
    """A restart marker out of sequence (RST1 where RST0 belongs): libjpeg warns and resynchronises."""
    at = blob.index(b"\xff\xd0", blob.index(b"\xff\xda"))
    return blob[:at] + b"\xff\xd1" + blob[at + 2:]


BIG = photo(512, 384)
BAD = {
    "truncated (no end marker)": lambda: cut_mid_scan(encode(BIG, quality=90), keep_end=False),
    "truncated mid-scan, end marker kept": lambda: cut_mid_scan(encode(BIG, quality=90), keep_end=True),
    "CMYK": lambda: encode(BIG.convert("CMYK"), quality=90),
    "12-bit": lambda: jpeg12(),
    "progressive with a bad restart marker": lambda: bad_restart(
        encode(BIG, quality=90, progressive=True, restart_marker_blocks=4)),
    "baseline with a bad restart marker": lambda: bad_restart(encode(BIG, quality=90, restart_marker_blocks=4)),
    **{f"EXIF orientation {k}": (lambda k=k: with_exif(BIG, k, quality=90)) for k in range(2, 9)},
}


@pytest.mark.parametrize("kind", sorted(BAD))
def test_what_the_scaled_path_cannot_decode_exactly_goes_the_full_path(kind):
    data = BAD[kind]()
    outcome = same_as_full_path(data, 16, 16)  # 1/8 covers the target: the scaled path would be taken
    if kind.startswith("truncated (no end"):
        assert outcome == "fails"
    if kind.startswith("EXIF"):
        assert outcome == "decodes" and not images.inspect(data).scalable


def test_the_header_check_says_what_is_scalable():
    assert images.inspect(encode(BIG, quality=90)).scalable
    assert images.inspect(encode(BIG, quality=90, progressive=True)).scalable
    assert images.inspect(encode(BIG.convert("L"), quality=90)).scalable
    assert images.inspect(with_exif(BIG, 1, quality=90)).scalable  # upright: nothing to rotate
    assert not images.inspect(encode(BIG.convert("CMYK"), quality=90)).scalable
    assert not images.inspect(jpeg12()).scalable
    assert not images.inspect(with_exif(BIG, 6, quality=90)).scalable
    assert not images.inspect(encode(BIG, "PNG")).scalable


def test_restart_markers_in_order_still_take_the_scaled_path():
    # the control for the bad-restart cases: well-formed restart intervals decode scaled, and close to full
    for kw in ({}, {"progressive": True}):
        data = encode(BIG, quality=90, restart_marker_blocks=4, **kw)
        scaled, full = decode.decode_for_seq(data, 16, 16), full_path(data, 16)
        assert scaled.shape == full.shape and not torch.equal(scaled, full)
        assert ((scaled.double() - full.double()) ** 2).mean() < 255 ** 2 / 10 ** 2.5  # > 25 dB


def test_pipeline_counts_the_same_undecodable_samples_in_both_modes():
    from naflex_accum.data.pipeline import decode_samples
    from naflex_accum.data.samples import Corruption, RawSample

    blobs = [encode(BIG, quality=90)] + [BAD[k]() for k in sorted(BAD)] + [encode(photo(300, 500, 3), quality=80)]
    counts = {}
    for mode in decode.DECODE_MODES:
        report = Corruption()
        samples = iter(RawSample(f"k{i}", "shard.tar", b, "a caption") for i, b in enumerate(blobs))
        got, _, keys = decode_samples(samples, len(blobs), 16, 16, report, "--train-data", mode)
        counts[mode] = (keys, report.count)
        assert all(tuple(img.shape[1:]) == tuple(full_path(blobs[int(k.split("#k")[1])], 16).shape[1:])
                   for img, k in zip(got, keys))
    assert counts["scaled"] == counts["full"] and counts["full"][1] >= 1


def test_a_bad_mode_is_one_clear_error(tmp_path):
    from naflex_accum.data import DataConfig, make_train_loader

    with pytest.raises(UsageError, match="--image-decode 'fast': expected one of scaled, full"):
        make_train_loader(DataConfig(train_data=str(tmp_path / "x.tar"), image_decode="fast"), None)
