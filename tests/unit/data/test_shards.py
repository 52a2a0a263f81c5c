"""data.shards: --train-data expansion (sources, braces, globs, folders), its one-line refusals, shard weights."""
import pytest

from naflex_accum.data.shards import expand_sources, expand_urls, local_path, shard_weights
from naflex_accum.errors import UsageError


@pytest.fixture
def shards(tmp_path):
    for folder, n in (("a", 3), ("b", 2)):
        (tmp_path / folder).mkdir()
        for k in range(n):
            (tmp_path / folder / f"{k:03d}.tar").write_bytes(b"")
    return tmp_path


def test_sources_braces_globs_and_folders_expand_in_order(shards):
    a, b = shards / "a", shards / "b"
    spec = f"{a}/{{000..002}}.tar::{b}/*.tar::{b}::pipe:cat {a}/000.tar"
    sources = expand_sources(spec)
    assert sources == [[f"{a}/{k:03d}.tar" for k in range(3)], [f"{b}/000.tar", f"{b}/001.tar"],
                       [f"{b}/000.tar", f"{b}/001.tar"], [f"pipe:cat {a}/000.tar"]]
    assert expand_urls(spec) == [url for source in sources for url in source]


@pytest.mark.parametrize("spec, words", [
    ("", "is empty"), ("   ", "is empty"), ("{a}/000.tar::", "empty source"), ("{a}/*.zip", "matches no files"),
    ("{a}/{{000..003}}.tar", "'{a}/003.tar' does not exist (1 of 4 shards"), ("{root}", "holds no .tar shards"),
])
def test_bad_specs_are_one_line_naming_the_flag(shards, spec, words):
    spec, words = (s.format(a=shards / "a", root=shards) for s in (spec, words))
    with pytest.raises(UsageError) as info:
        expand_urls(spec, flag="--val-data")
    message = str(info.value)
    assert message.startswith("--val-data") and words in message and "\n" not in message


def test_local_path_of_plain_file_and_remote_urls():
    assert local_path("/d/x.tar") == "/d/x.tar"
    assert local_path("file:///d/x%20y.tar") == "/d/x y.tar"
    assert local_path("pipe:cat x.tar") is None and local_path("s3://bucket/x.tar") is None


def test_each_shard_gets_its_sources_factor():
    sources = [["a0", "a1", "a2"], ["b0"]]
    assert shard_weights(sources, None, resampled=False) is None
    assert shard_weights(sources, "1::0.5", resampled=True) == [1.0, 1.0, 1.0, 0.5]
    assert shard_weights(sources, [2, 0], resampled=True) == [2.0, 2.0, 2.0, 0.0]


@pytest.mark.parametrize("factors, resampled, words", [
    ("1::1", False, "needs --dataset-resampled"), ("1", True, "has 1 factors but --train-data has 2"),
    ("1::x", True, "give numbers joined by '::'"), ("0::0", True, "not all 0"), ("1::-1", True, ">= 0"),
    ("1::nan", True, "finite"),
])
def test_bad_factors_are_one_line(factors, resampled, words):
    with pytest.raises(UsageError, match="--train-data-upsampling-factors") as info:
        shard_weights([["a"], ["b"]], factors, resampled)
    assert words in str(info.value)
