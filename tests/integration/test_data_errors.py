"""Corrupt data is survived and reported; bad inputs raise one clear line."""

import logging
import os

import pytest
import torch
from data_common import CharTokenizer, config, shard_paths, tar_members, write_tar
from unit.data.test_errors import good, one_line  # noqa: F401 (fixtures)

from naflex_accum.data import make_train_loader
from naflex_accum.errors import UsageError

torch.set_num_threads(1)


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
