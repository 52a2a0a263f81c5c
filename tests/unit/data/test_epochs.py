"""Exact epochs on the real loader, counted by sample key over whole epochs.

An epoch of the data set (the default) holds each sample once, but for the last step's remainder (less than one
step); a shorter one at most once; a longer one whole passes and part of one more. No contrastive batch holds a
sample twice: an optimizer step's window, every rank's rows of its --accum-freq batches. Whatever the workers,
ranks, slots, shuffle size, shard count and sizes.
"""

import collections
import math
import os

import pytest
import torch
from data_common import CharTokenizer, config, demo, reshard
from hypothesis import HealthCheck, given, settings, strategies as st

from naflex_accum.data import DataConfig, make_train_loader
from naflex_accum.errors import UsageError

torch.set_num_threads(1)

SHUFFLE = "sample_shuffle_size" if "sample_shuffle_size" in DataConfig.__dataclass_fields__ else "shuffle_buffer"

DEFAULT = DataConfig.__dataclass_fields__[SHUFFLE].default

LARGEST = 16  # the largest batch per rank: BUDGET 256 // the smallest sequence length, 16


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return demo(tmp_path_factory.mktemp("epochs"), num=640, val=8, shard_size=64).train


@pytest.fixture(scope="module")
def datasets(source, tmp_path_factory):
    made = {}

    def make(sizes):
        if sizes not in made:
            made[sizes] = reshard(source, sizes, str(tmp_path_factory.mktemp("sizes")))
        return made[sizes]
    return make


def global_batches(pattern, world, workers, slots, shuffle, num_samples=None, epoch=0, accum=1):
    """Every global batch's keys (rank 0's rows, then rank 1's, ...), and rank 0's loader."""
    loaders = [make_train_loader(config(pattern, world_size=world, rank=r, workers=workers, slots=slots,
                                        num_samples=num_samples, accum_freq=accum, **{SHUFFLE: shuffle}),
                                 CharTokenizer()) for r in range(world)]
    per_rank = []
    for ld in loaders:
        ld.set_epoch(epoch)
        per_rank.append([meta["keys"] for _, meta in ld.iter_meta()])
        ld.close()
    assert len({len(b) for b in per_rank}) == 1
    return [[k for rank in per_rank for k in rank[i]] for i in range(len(per_rank[0]))], loaders[0]


def windows(batches, accum):
    """Every optimizer step's keys: ``accum`` consecutive global batches."""
    return [[k for batch in batches[i:i + accum] for k in batch] for i in range(0, len(batches), accum)]


def check_epoch(batches, total, target, world, accum):
    for i, window in enumerate(windows(batches, accum)):
        assert len(set(window)) == len(window), f"window {i} holds a sample twice"
    counts = collections.Counter(k for batch in batches for k in batch)
    seen = sum(counts.values())
    step = accum * world * LARGEST
    assert target - step < seen <= target, (seen, target)  # at most the last step's remainder is left out
    passes, rest = divmod(seen, total)
    if seen <= total:
        assert max(counts.values()) == 1, "a sample twice in an epoch no longer than the data set"
    else:  # whole passes, each every sample once, and part of one more
        assert set(counts.values()) <= {passes, passes + 1} and len(counts) == total
        assert sum(1 for n in counts.values() if n == passes + 1) == rest
    return counts


def test_each_epoch_has_its_own_order(datasets):
    pattern = datasets((64,) * 8)
    first, _ = global_batches(pattern, 1, 0, 2, DEFAULT, epoch=0)
    second, _ = global_batches(pattern, 1, 0, 2, DEFAULT, epoch=1)
    assert [k for b in first for k in b] != [k for b in second for k in b]
    assert first == global_batches(pattern, 1, 0, 2, DEFAULT, epoch=0)[0]  # and is seeded


def test_refused_in_one_line(datasets):
    small = datasets((5, 6))  # 11 samples: less than one batch of 16
    with pytest.raises(UsageError, match=r"--train-data holds 11 samples, fewer than one batch") as info:
        make_train_loader(config(small, num_samples=None), CharTokenizer())
    assert "\n" not in str(info.value)
    tight = datasets((64,) * 3)  # 8 slots of 24: passes cannot meet without a repeat in a batch of 16
    with pytest.raises(UsageError, match=r"an epoch of .* spans passes .* use --train-num-samples <= 192") as info:
        make_train_loader(config(tight, num_samples=400, slots=8), CharTokenizer())
    with pytest.raises(UsageError, match=r"--dataset-resampled: each of the 16 data slots draws from its own 12"):
        make_train_loader(config(tight, num_samples=100, slots=16, dataset_resampled=True), CharTokenizer())


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                HealthCheck.too_slow])
@given(sizes=st.lists(st.integers(1, 90), min_size=1, max_size=9), world=st.integers(1, 3),
       per_rank=st.integers(1, 4), shuffle=st.sampled_from([0, 1, 8, 37, DEFAULT]),
       fraction=st.sampled_from([None, 0.5, 1.7]), epoch=st.integers(0, 3), accum=st.integers(1, 3))
def test_property_random_shards_and_settings(datasets, sizes, world, per_rank, shuffle, fraction, epoch, accum):
    total, slots = sum(sizes), world * per_rank
    target = total if fraction is None else max(1, int(total * fraction))
    pattern = datasets(tuple(sizes))
    try:
        batches, _ = global_batches(pattern, world, 0, slots, shuffle, None if fraction is None else target,
                                    epoch, accum)
    except UsageError as exc:  # only the documented refusals, in one line
        message = str(exc)
        assert "\n" not in message
        share = total // slots
        assert (total < world * LARGEST and "fewer than one batch" in message) or \
               (target > total and share < 2 * LARGEST * accum and "spans passes" in message) or \
               ("cannot fill one optimizer step" in message and target < world * LARGEST * accum), message
        return
    check_epoch(batches, total, target, world, accum)


def test_pure_order_passes_hold_every_sample_once():
    from naflex_accum.data.slots import DataIndex, EpochOrder

    sizes = [5, 200, 17, 90, 1, 150, 49, 3]
    index = DataIndex([f"s{k}" for k in range(len(sizes))], sizes)
    total = sum(sizes)
    for slots, window in ((1, 1000), (3, 8), (16, 37), (5, 0)):
        order = EpochOrder(index, 7, 2, slots, window, tail=LARGEST)
        ids = [int(order.order(s, q).ids([j])[0]) for s, q, j in map(order.locate, range(3 * total))]
        for q in range(3):
            assert sorted(ids[q * total:(q + 1) * total]) == list(range(total))
        for boundary in (total, 2 * total):  # no sample within a batch's reach on either side of a pass's end
            near = ids[boundary - slots * LARGEST:boundary + slots * LARGEST]
            if total // slots >= 2 * LARGEST:
                assert len(set(near)) == len(near)
        assert math.isclose(order.part_size(0), math.ceil(total / slots))


def test_a_shard_listed_twice_is_refused(datasets):
    pattern = datasets((64,) * 8).replace("{0000..0007}", "0003")
    with pytest.raises(UsageError, match=r"--train-data lists shard .*part-0003.tar' twice") as info:
        make_train_loader(config(f"{pattern}::{pattern}", num_samples=None), CharTokenizer())
    assert "\n" not in str(info.value)


def test_compressed_shards_hold_each_sample_once(datasets, tmp_path):
    import glob
    import gzip
    import shutil

    pattern = datasets((64,) * 4)
    for path in glob.glob(pattern.replace("{0000..0003}", "*")):
        with open(path, "rb") as src, gzip.open(tmp_path / (os.path.basename(path) + ".gz"), "wb") as dst:
            shutil.copyfileobj(src, dst)
    batches, _ = global_batches(f"{tmp_path}/part-{{0000..0003}}.tar.gz", 1, 0, 2, DEFAULT)
    counts = check_epoch(batches, 256, 256, 1, 1)
    assert len(counts) > 256 - 2 * LARGEST


def test_a_shard_under_two_names_is_refused(datasets, tmp_path):
    pattern = datasets((64,) * 2)
    first = pattern.replace("{0000..0001}", "0000")
    os.symlink(first, tmp_path / "link.tar")
    for spec in (f"{first}::{tmp_path}/link.tar", f"{first}::{os.path.dirname(first)}/./part-0000.tar"):
        with pytest.raises(UsageError, match=r"lists shard .* twice \(also as") as info:
            make_train_loader(config(spec, num_samples=None), CharTokenizer())
        assert "\n" not in str(info.value)


def test_a_sizes_json_count_the_file_cannot_hold_is_one_line(datasets, tmp_path):
    import json
    import shutil

    pattern = datasets((64,) * 2)
    folder = os.path.dirname(pattern)
    for name in ("part-0000.tar", "part-0001.tar"):
        shutil.copy(os.path.join(folder, name), tmp_path / name)
    (tmp_path / "sizes.json").write_text(json.dumps({"part-0000.tar": 10 ** 12, "part-0001.tar": 64}))
    with pytest.raises(UsageError, match=r"sizes.json lists 1000000000000 samples for part-0000.tar, more than"):
        make_train_loader(config(f"{tmp_path}/part-{{0000..0001}}.tar", num_samples=64), CharTokenizer())


def test_the_untrained_remainder_falls_anywhere_in_a_shard(datasets):
    pattern = datasets((101,) * 3)
    dropped = collections.Counter()
    for epoch in range(12):
        batches, _ = global_batches(pattern, 1, 0, 1, 20, epoch=epoch)
        seen = {k for batch in batches for k in batch}
        dropped.update(int(k.split("#")[1][5:]) % 101 for k in all_keys(pattern) - seen)
    # each epoch drops a few of the last reads of a pass: anywhere in a shard, not its tail every epoch
    assert dropped and min(dropped) < 50 and max(dropped) >= 50


def all_keys(pattern):
    from data_common import shard_paths, tar_members
    return {f"{p}#{name.split('.')[0]}" for p in shard_paths(pattern) for name, _ in tar_members(p)}
