"""make-demo-data: captions say what is drawn, sizes and aspects in range, deterministic, held-out split; val loader."""

import io
import json
import os
from collections import Counter

import pytest
import torch
from data_common import CharTokenizer, demo, shard_paths, tar_members
from PIL import Image

from naflex_accum.data import make_val_loader
from naflex_accum.data.demo import BACKGROUNDS, COLOURS, caption_for

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return demo(tmp_path_factory.mktemp("demo"), num=120, val=40, shard_size=50)


def samples(pattern):
    out = {}
    for path in shard_paths(pattern):
        for name, blob in tar_members(path):
            key, ext = name.split(".", 1)
            out.setdefault(key, {})[ext] = blob
    return out


def test_layout_and_sizes_json(data):
    train, val = shard_paths(data.train), shard_paths(data.val)
    assert [os.path.basename(p) for p in train] == ["shard-000000.tar", "shard-000001.tar", "shard-000002.tar"]
    assert len(val) == 1
    with open(os.path.join(os.path.dirname(train[0]), "sizes.json")) as f:
        assert json.load(f) == {"shard-000000.tar": 50, "shard-000001.tar": 50, "shard-000002.tar": 20}
    assert data.num_train == 120 and data.num_val == 40
    tr, va = samples(data.train), samples(data.val)
    assert len(tr) == 120 and len(va) == 40
    assert all(set(s) in ({"jpg", "txt", "json"}, {"png", "txt", "json"}) for s in tr.values())
    def image(s):
        return s.get("jpg") or s["png"]
    assert not {image(s) for s in va.values()} & {image(s) for s in tr.values()}  # held out: its own seed stream


def test_images_and_captions(data):
    formats = Counter()
    for key, s in samples(data.train).items():
        attrs = json.loads(s["json"])
        assert s["txt"].decode() == caption_for(attrs) == attrs["caption"]
        img = Image.open(io.BytesIO(s.get("jpg") or s["png"]))
        formats[img.format] += 1
        w, h = img.size
        assert (w, h) == (attrs["width"], attrs["height"])
        assert 32 <= w <= 512 and 32 <= h <= 512 and 0.25 <= w / h <= 4.0
        assert attrs["colour"] != attrs["background"]
        # the named background is in the corner away from the shape, the named colour where the shape is
        rgb = img.convert("RGB")
        pos = attrs["position"]
        far = (w - 2 if "left" in pos else 1, h - 2 if "top" in pos else 1) if pos != "centre" else (1, 1)
        assert _close(rgb.getpixel(far), BACKGROUNDS[attrs["background"]]), (key, attrs)
        assert _close(_shape_pixel(rgb, attrs), COLOURS[attrs["colour"]]), (key, attrs)
    assert formats["JPEG"] > formats["PNG"] > 0


def _close(a, b, tol=40):
    return max(abs(x - y) for x, y in zip(a, b)) <= tol


def _shape_pixel(img, attrs):
    # The shape sits in the named corner: scan from that corner along the diagonal for the first non-background.
    w, h = img.size
    pos = attrs["position"]
    bg = BACKGROUNDS[attrs["background"]]
    if pos == "centre":
        return img.getpixel((w // 2, h // 2))
    x0, dx = (0, 1) if "left" in pos else (w - 1, -1)
    y0, dy = (0, 1) if "top" in pos else (h - 1, -1)
    steps = min(w, h)
    for t in range(steps):
        p = img.getpixel((x0 + dx * t, y0 + dy * t))
        if not _close(p, bg, 60):
            # step a little further in, past any JPEG ringing at the edge
            t2 = min(t + max(3, steps // 12), steps - 1)
            return img.getpixel((x0 + dx * t2, y0 + dy * t2))
    return bg


def test_deterministic_and_seeded(tmp_path):
    a = demo(tmp_path / "a", num=20, val=5, shard_size=7)
    b = demo(tmp_path / "b", num=20, val=5, shard_size=20)     # shard size does not change the samples
    c = demo(tmp_path / "c", num=20, val=5, shard_size=7, seed=1)
    assert samples(a.train) == samples(b.train) and samples(a.val) == samples(b.val)
    assert samples(a.train) != samples(c.train)
    again = demo(tmp_path / "a2", num=20, val=5, shard_size=7)
    for p, q in zip(shard_paths(a.train), shard_paths(again.train)):
        with open(p, "rb") as f1, open(q, "rb") as f2:
            assert f1.read() == f2.read()


def test_val_num_samples_without_sizes_json(data, tmp_path):
    path = shard_paths(data.val)[0]
    os.symlink(path, tmp_path / "v.tar")
    val = make_val_loader(str(tmp_path / "v.tar"), CharTokenizer(), seq_len=16, batch_size=64)
    assert val.num_samples == 40
    assert [b["text"].shape[0] for b in val] == [40]


def test_the_demo_never_removes_a_folder_it_did_not_write(tmp_path, monkeypatch):
    """``demo --data-dir`` named a user's folder: it removed it and wrote the demo data there."""
    from naflex_accum.commands.demo import ensure_demo_data
    from naflex_accum.errors import UsageError

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "precious.txt").write_text("kept")
    (tmp_path / "a-file").write_text("kept")
    monkeypatch.chdir(tmp_path / "mine")
    for given in (tmp_path / "mine", tmp_path / "a-file", os.path.curdir):  # '.' was a traceback
        with pytest.raises(UsageError, match=r"exists and is no demo data folder \(it has no patterns.txt\)"):
            ensure_demo_data(type(tmp_path)(given), 8, 4)
    assert (tmp_path / "mine" / "precious.txt").read_text() == (tmp_path / "a-file").read_text() == "kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "mine"]  # nothing written beside them


def test_a_demo_data_folder_that_cannot_be_written_or_has_nothing_held_out_is_one_line(tmp_path):
    """Red before: a NotADirectoryError traceback; --val-samples 0 a ValueError after the data was written."""
    from naflex_accum.commands import demo
    from naflex_accum.errors import UsageError

    (tmp_path / "a-file").write_text("kept")
    with pytest.raises(UsageError, match=r"^cannot write \S+/a-file/sub: \[Errno 20\] Not a directory"):
        demo.ensure_demo_data(tmp_path / "a-file" / "sub", 8, 4)
    with pytest.raises(UsageError, match=r"^--val-samples must be a positive integer, got 0$"):
        demo.main(["--data-dir", str(tmp_path / "new"), "--val-samples", "0"])
    assert not (tmp_path / "new").exists()
