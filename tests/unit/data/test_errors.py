"""Corrupt data is survived and reported; bad inputs raise one clear line."""

import json
import logging
import os

import pytest
import torch
from data_common import CharTokenizer, config, demo, shard_paths, write_tar

from naflex_accum.data import make_train_loader, make_val_loader
from naflex_accum.errors import UsageError

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return demo(tmp_path_factory.mktemp("errors"), num=64, val=0)


def one_line(exc_info):
    assert "\n" not in str(exc_info.value)
    return str(exc_info.value)


@pytest.mark.parametrize("spec,match", [
    ("", r"--train-data is empty"),
    ("{dir}/shard-{{000000..000009}}.tar", r"--train-data: shard file '.*shard-000004.tar' does not exist "
                                           r"\(6 of 10 shards of .* missing\)"),
    ("{dir}/nope-*.tar", r"--train-data: pattern '.*nope-\*.tar' matches no files"),
    ("{dir}/shard-000000.tar::", r"--train-data .* has an empty source"),
    ("{empty}", r"--train-data: directory .* holds no .tar shards"),
])
def test_bad_train_data(spec, match, good, tmp_path):
    folder = os.path.dirname(shard_paths(good.train)[0])
    with pytest.raises(UsageError, match=match) as info:
        make_train_loader(config(spec.format(dir=folder, empty=tmp_path)), CharTokenizer())
    one_line(info)


def test_seq_len_above_budget(good):
    with pytest.raises(UsageError, match=r"--naflex-seq-lens 1024.*--naflex-max-tokens-per-batch 256") as info:
        make_train_loader(config(good.train, seq_lens=(64, 1024)), CharTokenizer())
    one_line(info)


def test_epoch_size_from_sizes_json_or_a_count(good, tmp_path, caplog):
    loader = make_train_loader(config(good.train, num_samples=None), CharTokenizer())
    assert loader.index.total == 64 and loader.num_samples <= 64  # the demo's sizes.json
    paths = shard_paths(good.train)
    for p in paths[:2]:
        os.symlink(p, tmp_path / os.path.basename(p))
    with caplog.at_level(logging.INFO, logger="naflex_accum.data"):
        counted = make_train_loader(config(f"{tmp_path}/*.tar", num_samples=None), CharTokenizer())
    assert counted.index.counts == [16, 16] and "counted the samples of 2 shard(s)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="naflex_accum.data"):
        again = make_train_loader(config(f"{tmp_path}/*.tar", num_samples=None), CharTokenizer())
    assert again.index.counts == [16, 16] and "counted" not in caplog.text  # from the cache
    (tmp_path / "sizes.json").write_text(json.dumps({os.path.basename(paths[0]): 12}))  # lists only one shard
    mixed = make_train_loader(config(f"{tmp_path}/*.tar", num_samples=None), CharTokenizer())
    assert mixed.index.counts == [12, 16]
    by_tokens = make_train_loader(config(f"{tmp_path}/*.tar", num_samples=None, num_image_tokens=1000),
                                  CharTokenizer())
    assert 0 < by_tokens.num_token_slots <= 1000


@pytest.mark.parametrize("kw,match", [
    (dict(rank=2, world_size=2), r"rank 2 is not below world_size 2"),
    (dict(workers=-1), r"--workers must be an integer >= 0"),
    (dict(num_samples=10, num_image_tokens=1000), r"give one of --train-num-samples \(10\) or "
                                                   r"--naflex-num-train-image-tokens \(1000\), not both"),
])
def test_bad_distribution_settings(good, kw, match):
    with pytest.raises(UsageError, match=match):
        make_train_loader(config(good.train, **kw), CharTokenizer())


def test_val_errors(tmp_path, good):
    with pytest.raises(UsageError, match=r"--val-data: pattern .* matches no files"):
        make_val_loader(f"{tmp_path}/*.tar", CharTokenizer())
    write_tar(tmp_path / "empty.tar", [])
    with pytest.raises(UsageError, match=r"--val-data: no usable samples"):
        list(make_val_loader(str(tmp_path / "empty.tar"), CharTokenizer()))
    with pytest.raises(UsageError, match=r"val batch_size must be an integer >= 1"):
        make_val_loader(good.train, CharTokenizer(), batch_size=0)


def test_cli_prints_one_line_and_exits_2(tmp_path, capsys):
    from naflex_accum.cli import main
    (tmp_path / "keep.txt").write_text("mine")
    assert main(["make-demo-data", str(tmp_path), "--num-samples", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("naflex-accum make-demo-data: error: DIR") and "--force" in err and "\n" not in err
    assert sorted(os.listdir(tmp_path)) == ["keep.txt"]
