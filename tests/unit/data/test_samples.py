"""data.samples: members grouped by key and numbered in tar order, bad samples reported (never raised)."""
import io
import os

import pytest
from data_common import write_tar
from PIL import Image

from naflex_accum.data.samples import (MAX_MESSAGES, Corruption, ShardReadError, _split_name, checked, count_samples,
                                       shard_groups, shard_samples, tar_members)


def _png():
    out = io.BytesIO()
    Image.new("RGB", (4, 3), (10, 20, 30)).save(out, format="PNG")
    return out.getvalue()


PNG = _png()


@pytest.fixture
def shard(tmp_path):
    members = [("s0.png", PNG), ("s0.txt", b"a cat"),
               ("s1.png", PNG),                                 # no caption
               ("s2.jpg", b"not an image"), ("s2.txt", b"junk"),  # undecodable
               ("noext", b"x"),                                 # not a sample member: skipped, not counted
               ("d/s3.PNG", PNG), ("d/s3.txt", b"  a dog \n"),
               ("s4.txt", "é".encode("latin-1")), ("s4.png", PNG),  # caption not UTF-8
               ("s5.png", PNG), ("s5.txt", b"last")]
    return write_tar(tmp_path / "shard.tar", members)


def test_split_name_is_webdatasets_key_and_extension():
    assert _split_name("a/b/k.seg.JPG") == ("a/b/k", "seg.jpg")
    assert _split_name("k.txt") == ("k", "txt")
    assert _split_name("noext") == (None, None) and _split_name("d/.hidden") == (None, None)


def test_usable_samples_in_tar_order_and_each_bad_one_reported_once(shard):
    report = Corruption()
    got = [(s.key, s.caption) for s in shard_samples(shard, report)]
    assert got == [("s0", "a cat"), ("d/s3", "a dog"), ("s5", "last")]
    count, messages = report.drain()
    assert count == 3 and len(messages) == 3
    assert "key 's1': missing caption" in messages[0] and "key 's2': undecodable image .jpg" in messages[1]
    assert "key 's4': caption is not UTF-8" in messages[2]
    assert report.drain() == (0, [])


def test_checked_refuses_no_image_and_empty_caption():
    report = Corruption()
    assert checked("u", "k", {"txt": b"cap"}, report) is None
    assert checked("u", "k", {"png": PNG, "txt": b"   "}, report) is None
    assert checked("u", "k", {"webp": PNG, "png": b"", "txt": b"x"}, report) is None  # png is preferred
    sample = checked("u", "k", {"jpeg": PNG, "txt": b"x"}, report)
    assert sample.data == PNG and sample.caption == "x"
    count, messages = report.drain()
    assert count == 3 and "no image" in messages[0] and "empty caption" in messages[1]


def test_corruption_counts_exactly_keeps_the_first_messages_and_strips_object_reprs():
    report = Corruption()
    for k in range(MAX_MESSAGES + 5):
        report.add("u", None, f"bad {k} <_io.BytesIO object at 0x7f{k:04x}>")
    count, messages = report.drain()
    assert count == MAX_MESSAGES + 5 and len(messages) == MAX_MESSAGES
    assert messages[0] == "u: bad 0" and report.last == f"u: bad {MAX_MESSAGES + 4}"


def test_sample_numbers_agree_between_count_and_groups(shard):
    assert count_samples(shard) == (6, None)
    groups = list(shard_groups(shard))
    assert [(n, key) for n, key, _ in groups] == [(0, "s0"), (1, "s1"), (2, "s2"), (3, "d/s3"), (4, "s4"),
                                                   (5, "s5")]
    assert [(n, key) for n, key, _ in shard_groups(shard, 2, 4)] == [(2, "s2"), (3, "d/s3")]
    assert list(shard_groups(shard, 5))[0][2] == {"png": PNG, "txt": b"last"}


def test_a_truncated_shard_counts_and_keeps_the_samples_before_the_damage(shard, tmp_path):
    cut = tmp_path / "cut.tar"
    data = open(shard, "rb").read()
    cut.write_bytes(data[:len(data) // 2 + 100])  # inside a header
    count, problem = count_samples(str(cut))
    assert 0 < count < 6 and problem.startswith("ReadError")
    report = Corruption()
    kept = list(shard_samples(str(cut), report))
    assert [s.key for s in kept][:2] == ["s0", "d/s3"]
    assert any("unreadable shard (ReadError" in m for m in report.drain()[1])


def test_a_shard_the_os_cannot_read_raises_instead_of_counting(tmp_path):
    missing = str(tmp_path / "gone.tar")
    with pytest.raises(ShardReadError, match=r"gone.tar cannot be read: \[Errno 2\].*\(ENOENT\); its storage"):
        count_samples(missing)
    with pytest.raises(ShardReadError):
        list(shard_samples(missing, Corruption()))
    assert not os.path.exists(missing)
    assert list(tar_members(write_tar(tmp_path / "one.tar", [("a.txt", b"x")]))) == [("a.txt", b"x")]
