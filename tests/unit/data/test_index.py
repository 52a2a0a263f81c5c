"""data.index: shard sizes from sizes.json, else counted once and cached while the file is unchanged."""
import json
import logging
import os

import pytest
from data_common import write_tar

from naflex_accum.data import index
from naflex_accum.data.index import cache_dir, canonical, listed_total, same_file, shard_sizes
from naflex_accum.errors import TransientError


def _shard(path, samples):
    return write_tar(path, [m for k in range(samples) for m in ((f"k{k}.png", b"i"), (f"k{k}.txt", b"c"))])


@pytest.fixture
def shards(tmp_path, monkeypatch):
    monkeypatch.setenv("NAFLEX_ACCUM_CACHE", str(tmp_path / "cache"))
    (tmp_path / "d").mkdir()
    return [_shard(tmp_path / "d" / f"{k}.tar", n) for k, n in enumerate((3, 5))]


@pytest.fixture
def counts(monkeypatch):
    calls = []
    real = index.count_samples

    def counting(url):
        calls.append(url)
        return real(url)
    monkeypatch.setattr(index, "count_samples", counting)
    return calls


def test_sizes_json_listing_every_shard_is_believed_without_counting(shards, counts):
    folder = os.path.dirname(shards[0])
    with open(os.path.join(folder, "sizes.json"), "w") as f:
        json.dump({"0.tar": 2, "1.tar": 4}, f)  # not the true counts: proof nothing was read
    assert shard_sizes(shards) == [2, 4] and listed_total(shards) == 6 and counts == []


def test_entries_that_are_not_counts_are_counted_instead(shards, counts):
    with open(os.path.join(os.path.dirname(shards[0]), "sizes.json"), "w") as f:
        json.dump({"0.tar": True, "1.tar": -1}, f)
    assert shard_sizes(shards) == [3, 5] and counts == shards and listed_total(shards) is None


def test_counts_are_cached_while_the_file_is_unchanged(shards, counts):
    assert shard_sizes(shards) == [3, 5] and len(counts) == 2
    assert shard_sizes(shards) == [3, 5] and len(counts) == 2  # from the cache
    _shard(shards[1], 7)
    os.utime(shards[1], ns=(1, 1))  # another size and modification time: counted again
    assert shard_sizes(shards) == [3, 7] and counts[2:] == [shards[1]]
    assert any(name.startswith("sizes-") for name in os.listdir(cache_dir()))


def test_an_unwritable_cache_costs_a_warning_not_the_run(shards, tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("NAFLEX_ACCUM_CACHE", str(blocker / "sub"))
    with caplog.at_level(logging.WARNING):
        assert shard_sizes(shards) == [3, 5]
    assert "cannot cache shard sizes" in caplog.text and "NAFLEX_ACCUM_CACHE" in caplog.text


def test_a_remote_source_that_fails_is_transient_not_a_short_count(shards, monkeypatch):
    monkeypatch.setattr(index, "count_samples", lambda url: (2, "ReadError: cut short"))
    with pytest.raises(TransientError, match=r"--val-data: cannot count the samples of 's3://b/x.tar' \(ReadError"):
        shard_sizes(["s3://b/x.tar"], flag="--val-data")


def test_a_local_shard_damaged_part_way_counts_what_precedes_with_a_warning(shards, counts, caplog):
    with open(shards[1], "r+b") as f:
        f.truncate(512 * 5 + 100)  # inside the data of k1.png: sample k0 is whole
    with caplog.at_level(logging.WARNING):
        assert shard_sizes(shards) == [3, 1]
        assert shard_sizes(shards) == [3, 1]
    assert counts.count(shards[1]) == 2  # a damaged count is never cached
    assert "cannot be read past its sample 1" in caplog.text


def test_cache_dir_order_and_a_shards_identity(tmp_path, monkeypatch):
    monkeypatch.setenv("NAFLEX_ACCUM_CACHE", "/explicit")
    assert cache_dir() == "/explicit"
    monkeypatch.delenv("NAFLEX_ACCUM_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", "/xdg")
    assert cache_dir() == "/xdg/naflex-accum"
    shard = _shard(tmp_path / "a.tar", 1)
    os.symlink(shard, tmp_path / "link.tar")
    assert same_file(str(tmp_path / "link.tar")) == same_file(f"file://{shard}") == same_file(shard)
    assert canonical(str(tmp_path / "." / "link.tar")) == os.path.realpath(shard)
    assert canonical("pipe:cat x") == "pipe:cat x" == same_file("pipe:cat x")
