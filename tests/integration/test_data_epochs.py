"""Exact epochs on the real loader, counted by sample key over whole epochs.

An epoch of the data set (the default) holds each sample once, but for the last step's remainder (less than one
step); a shorter one at most once; a longer one whole passes and part of one more. No contrastive batch holds a
sample twice: an optimizer step's window, every rank's rows of its --accum-freq batches. Whatever the workers,
ranks, slots, shuffle size, shard count and sizes.
"""


import os
import zlib

import pytest
import torch
from unit.data.test_epochs import (DEFAULT, check_epoch, datasets, global_batches, source,  # noqa: F401 (fixtures)
                                   windows)

torch.set_num_threads(1)


GRID = [  # shard sizes, world, workers, slots, shuffle, accum
    ((64,) * 8, 1, 0, 1, DEFAULT, 1),
    ((64,) * 8, 2, 2, 4, 8, 2),
    ((64,) * 8, 4, 0, 8, 100, 1),
    ((512,), 1, 3, 3, 10_000, 2),                      # one shard, three slots
    ((64,) * 3, 1, 0, 8, DEFAULT, 1),                  # fewer shards than slots
    ((5, 200, 17, 90, 1, 150, 49), 3, 1, 6, DEFAULT, 2),  # uneven
    ((8,) * 64, 2, 1, 16, DEFAULT, 1),                 # 64 shards, 16 slots
    ((40,) * 16, 4, 3, 16, 32, 1),
    ((100, 3, 300, 7, 101), 2, 0, 2, 0, 3),            # no shuffle within a slot
    ((64,) * 10, 1, 2, 5, 10_000, 1),
]


@pytest.mark.parametrize("sizes,world,workers,slots,shuffle,accum", GRID)
def test_an_epoch_of_the_data_set_holds_each_sample_once(datasets, sizes, world, workers, slots, shuffle, accum):
    batches, loader = global_batches(datasets(sizes), world, workers, slots, shuffle, accum=accum)
    counts = check_epoch(batches, sum(sizes), sum(sizes), world, accum)
    assert sum(counts.values()) == loader.num_samples


@pytest.mark.parametrize("sizes,world,workers,slots,shuffle,_", GRID[1::3])
def test_a_shorter_epoch_holds_each_sample_at_most_once(datasets, sizes, world, workers, slots, shuffle, _):
    target = sum(sizes) * 2 // 3
    batches, _ = global_batches(datasets(sizes), world, workers, slots, shuffle, num_samples=target, epoch=1,
                                accum=2)
    check_epoch(batches, sum(sizes), target, world, 2)


@pytest.mark.parametrize("sizes,world,workers,slots,shuffle,accum", [GRID[0], GRID[3], GRID[8]])
def test_a_longer_epoch_is_whole_passes_and_part_of_one_more(datasets, sizes, world, workers, slots, shuffle, accum):
    target = sum(sizes) * 5 // 2
    batches, loader = global_batches(datasets(sizes), world, workers, slots, shuffle, num_samples=target,
                                     accum=accum)
    check_epoch(batches, sum(sizes), target, world, accum)
    assert "2 whole pass(es)" in loader.describe()


def test_the_issue_cases_of_repeats_and_misses(datasets):
    # 16 shards of 256, 2 slots, the default shuffle: 598 samples were missed and 598 seen twice
    sizes = (40,) * 16
    batches, _ = global_batches(datasets(sizes), 1, 2, 2, DEFAULT)
    check_epoch(batches, 640, 640, 1, 1)


@pytest.mark.parametrize("accum", [1, 2])
def test_resampled_windows_never_hold_a_sample_twice(datasets, accum):
    pattern = datasets((64,) * 4)  # few samples a slot: draws with replacement collide often
    batches, _ = global_batches(pattern, 2, 1, 4, 8, num_samples=1000, accum=accum)
    # check_epoch's "no window holds a sample twice"; the counts themselves follow the draws
    for i, window in enumerate(windows(batches, accum)):
        assert len(set(window)) == len(window), f"window {i} holds a sample twice"


def test_a_slot_whose_part_lies_in_an_unreadable_shard_takes_stand_ins_from_other_parts(datasets, tmp_path):
    import shutil

    pattern = datasets((64,) * 5)
    folder = os.path.dirname(pattern)
    for k in range(5):
        shutil.copy(os.path.join(folder, f"part-{k:04d}.tar"), tmp_path / f"part-{k:04d}.tar")
    from data_common import tar_members, write_tar
    members = tar_members(tmp_path / "part-0002.tar")  # every image of it garbage: no usable sample
    write_tar(tmp_path / "part-0002.tar", [(n, b"junk" if n.endswith((".jpg", ".png")) else d) for n, d in members])
    sizes = {f"part-{k:04d}.tar": 64 for k in range(5)}
    (tmp_path / "sizes.json").write_text(__import__("json").dumps(sizes))
    batches, loader = global_batches(f"{tmp_path}/part-{{0000..0004}}.tar", 2, 1, 10, DEFAULT, accum=2)
    keys = [k for batch in batches for k in batch]
    assert not any("part-0002" in k for k in keys)
    for i, window in enumerate(windows(batches, 2)):
        assert len(set(window)) == len(window), f"window {i} holds a sample twice"
    assert loader.stats["standins"] == loader.stats["corrupt"] > 0  # rank 0's rows of that part


@pytest.mark.parametrize("target", [None, 1500])
def test_stand_ins_never_repeat_a_sample_of_their_window(datasets, tmp_path, target):
    # one sample in 20 unusable; --accum-freq 4: a window is 4 batches, and its stand-ins come from outside it
    import json
    import shutil

    from data_common import tar_members, write_tar

    pattern = datasets((64,) * 8)
    folder = os.path.dirname(pattern)
    for k in range(8):
        members = tar_members(os.path.join(folder, f"part-{k:04d}.tar"))
        write_tar(tmp_path / f"part-{k:04d}.tar",
                  [(n, b"junk" if n.endswith((".jpg", ".png")) and zlib.crc32(n.encode()) % 20 == 0 else d)
                   for n, d in members])
    shutil.copy(os.path.join(folder, "sizes.json"), tmp_path / "sizes.json")
    json.loads((tmp_path / "sizes.json").read_text())
    batches, loader = global_batches(f"{tmp_path}/part-{{0000..0007}}.tar", 2, 1, 2, DEFAULT, num_samples=target,
                                     accum=4)
    assert loader.stats["standins"] > 0
    for i, window in enumerate(windows(batches, 4)):
        assert len(set(window)) == len(window), f"window {i} holds a sample twice"
