"""Corrupt data is survived and reported; bad inputs raise one clear line."""
import json
import logging
import os

import pytest
import torch

from naflex_accum.data import make_train_loader, make_val_loader
from naflex_accum.errors import UsageError
from test_data_common import CharTokenizer, config, demo, shard_paths, tar_members, write_tar

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return demo(tmp_path_factory.mktemp("errors"), num=64, val=0)


@pytest.fixture(scope="module")
def corrupt_dir(good, tmp_path_factory):
    """Two good shards, one with bad samples, one truncated tar."""
    out = tmp_path_factory.mktemp("corrupt")
    paths = shard_paths(good.train)
    members = tar_members(paths[0])
    bad = []
    for name, data in members:
        if name.startswith("train00000001."):          # garbage image bytes
            data = b"this is not an image" if name.endswith((".jpg", ".png")) else data
        if name == "train00000002.txt":                 # missing caption
            continue
        if name.startswith("train00000003.") and name.endswith((".jpg", ".png")):
            data = data[:len(data) // 3]                # valid header, truncated pixels
        bad.append((name, data))
    write_tar(out / "bad-000.tar", bad)
    with open(paths[1], "rb") as f:
        blob = f.read()
    with open(out / "bad-001.tar", "wb") as f:
        f.write(blob[:len(blob) // 2 + 123])            # cut mid-member
    for k, p in enumerate(paths[2:4]):
        os.symlink(p, out / f"ok-00{k}.tar")
    return out


def one_line(exc_info):
    assert "\n" not in str(exc_info.value)
    return str(exc_info.value)


@pytest.mark.parametrize("workers", [0, 2])
def test_corrupt_samples_and_shards_are_survived_and_reported(corrupt_dir, caplog, workers):
    spec = f"{corrupt_dir}/bad-{{000..001}}.tar::{corrupt_dir}/ok-*.tar"
    with caplog.at_level(logging.WARNING, logger="naflex_accum.data"):
        loader = make_train_loader(config(spec, num_samples=None, workers=workers, sample_shuffle_size=0),
                                   CharTokenizer())
        specs = loader.schedule(0)
        batches = list(loader.iter_meta())
    assert len(batches) == loader.num_batches
    assert [b["text"].shape[0] for b, _ in batches] == [s.batch_size for s in specs]  # batches still full
    assert all(len(set(m["keys"])) == len(m["keys"]) for _, m in batches)  # a stand-in is never a repeat in a batch
    assert loader.stats["standins"] == loader.stats["corrupt"] >= 4  # each unusable row took a stand-in
    text = caplog.text
    assert "bad-000.tar key 'train00000001'" in text and "undecodable image" in text
    assert "bad-000.tar key 'train00000002': missing caption" in text
    assert "bad-000.tar key 'train00000003'" in text
    assert "bad-001.tar cannot be read past its sample" in text  # the count, at the start
    assert "bad-001.tar: sample" in text and "cannot be read past sample" in text
    assert "unusable" in text and "took a stand-in" in text


def test_no_usable_samples_is_a_usage_error(tmp_path, good):
    members = tar_members(shard_paths(good.train)[0])
    write_tar(tmp_path / "json-only.tar", [(n, d) for n, d in members if n.endswith(".json")])
    write_tar(tmp_path / "garbage.tar", [(n, b"junk" if not n.endswith(".txt") else d) for n, d in members])
    write_tar(tmp_path / "empty.tar", [])
    for workers in (0, 2):
        loader = make_train_loader(config(f"{tmp_path}/*.tar", workers=workers, num_samples=None), CharTokenizer())
        with pytest.raises(UsageError, match=r"--train-data: no usable sample left to stand in") as info:
            list(loader)
        assert "no image" in one_line(info)  # the last problem met says why
    (tmp_path / "empty").mkdir()
    only_empty = write_tar(tmp_path / "empty" / "empty.tar", [])
    with pytest.raises(UsageError, match=r"--train-data: its 1 shard\(s\) hold no samples") as info:
        make_train_loader(config(only_empty, num_samples=None), CharTokenizer())
    one_line(info)


def test_undecodable_pixels_everywhere_is_a_usage_error(tmp_path, good, monkeypatch):
    import naflex_accum.data.fill as fill
    monkeypatch.setattr(fill, "MAX_CONSECUTIVE_FAILURES", 5)
    members = tar_members(shard_paths(good.train)[0])
    cut = [(n, d[:200] if n.endswith((".jpg", ".png")) else d) for n, d in members]
    for k in range(3):  # more samples than one batch: stand-ins are looked for, and fail in a row too
        write_tar(tmp_path / f"cut-{k}.tar", [(f"s{k}-{n}", d) for n, d in cut])
    with pytest.raises(UsageError, match=r"--train-data: 5 images in a row failed to decode") as info:
        list(make_train_loader(config(f"{tmp_path}/cut-*.tar", num_samples=None), CharTokenizer()))
    one_line(info)


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
