"""Mid-epoch resume without decoding the skipped part, persistent pinned workers, and resampled shard streams."""

import os

import pytest
import torch
from data_common import CharTokenizer, config, shard_paths, tar_members, write_tar
from unit.data.test_resume import epoch, same, shards  # noqa: F401 (fixtures)

from naflex_accum.data import make_train_loader
from naflex_accum.data.workers import of as worker_processes

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def damaged(shards, tmp_path_factory):
    """The demo shards plus one whose images are cut short or garbage: both kinds a resume must count alike."""
    out = tmp_path_factory.mktemp("damaged")
    members = []
    for k, (name, data) in enumerate(tar_members(shard_paths(shards)[0])):
        if name.endswith((".jpg", ".png")) and k % 9 == 0:
            data = data[:len(data) // 2]
        elif name.endswith((".jpg", ".png")) and k % 7 == 0:
            data = b"garbage" * 10
        members.append((name, data))
    write_tar(out / "damaged.tar", members)
    return f"{out}/damaged.tar::" + shards


@pytest.mark.parametrize("workers", [0, 2])
def test_resumed_epoch_yields_the_uninterrupted_batches(shards, damaged, workers):
    for spec in (shards, damaged):
        loader = make_train_loader(config(spec, workers=workers, num_samples=160), CharTokenizer())
        whole = epoch(loader, 1)
        assert len(whole) == loader.num_batches > 6
        assert (loader.stats["corrupt"] > 0) == (spec == damaged)
        for start in (1, loader.num_batches // 2, loader.num_batches - 1, loader.num_batches):
            resumed = epoch(loader, 1, start)
            assert same(resumed, whole[start:]), (spec, start)
            assert loader.stats["batches"] == loader.num_batches - start


def test_persistent_pinned_workers_follow_set_epoch(shards):
    plain = make_train_loader(config(shards, workers=2), CharTokenizer())
    pinned = make_train_loader(config(shards, workers=2), CharTokenizer(), pin_memory=True)
    pids = []
    for number, start in ((0, 0), (1, 0), (1, 3), (2, 0)):
        assert same(epoch(pinned, number, start), epoch(plain, number, start))
        pids.append(sorted(w.pid for w in worker_processes(pinned._workers)))
        if torch.cuda.is_available():
            assert next(iter(pinned))["image"]["patches"].is_pinned()
    assert pids[0] == pids[-1] and pinned._workers.persistent_workers  # the same processes every epoch
    assert len(pids[0]) == 2 and os.getpid() not in pids[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("workers", [0, 2])
def test_pinned_batches_reach_the_gpu_without_a_sync(shards, workers):
    loader = make_train_loader(config(shards, workers=workers, num_samples=40), CharTokenizer(), pin_memory=True)
    expected = epoch(make_train_loader(config(shards, workers=workers, num_samples=40), CharTokenizer()), 0)
    loader.set_epoch(0)
    moved = []
    for batch in loader:
        assert all(t.is_pinned() for t in (batch["text"], *batch["image"].values()))
        torch.cuda.set_sync_debug_mode("error")  # a copy from pageable memory would synchronise, and raise here
        try:
            moved.append({"text": batch["text"].to("cuda", non_blocking=True),
                          "image": {k: v.to("cuda", non_blocking=True) for k, v in batch["image"].items()}})
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert same([{"text": b["text"].cpu(), "image": {k: v.cpu() for k, v in b["image"].items()}} for b in moved],
                expected)
