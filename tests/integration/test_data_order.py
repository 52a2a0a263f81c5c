"""The global sample order (data.order): independent of the workers and the world size; resized segments."""

import pytest
import torch
from data_common import CharTokenizer, config, demo
from unit.data.test_order import SLOTS  # noqa: F401 (fixtures)

from naflex_accum.data import make_train_loader


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return demo(tmp_path_factory.mktemp("order"), num=240, val=8, shard_size=10)[0]


def loader(shards, world=1, rank=0, workers=0, **kw):
    kw.setdefault("sample_shuffle_size", 1000)
    return make_train_loader(config(shards, world_size=world, rank=rank, workers=workers, slots=SLOTS, **kw),
                             CharTokenizer())


def run(ld, epoch=0, start=0, segment=None):
    ld.set_epoch(epoch, start, segment)
    return list(ld.iter_meta())


def global_order(shards, count):
    """The first ``count`` samples of epoch 0's global order: what one rank of world size 1 reads."""
    keys, ld = [], loader(shards, num_samples=count)
    for _, meta in run(ld):
        keys.extend(meta["keys"])
    assert count - 16 < len(keys) <= count  # within one step of it
    return keys


def seen(loaders, segment=None, start=0):
    """``{global position: key}`` over every rank's batches (position from the order's rule)."""
    out = {}
    for ld in loaders:
        segment_ = segment if segment is not None else None
        batches = run(ld, segment_.epoch if segment_ else 0, start, segment_)
        world, base = ld.cfg.world_size, ld.segment.base
        cursor = sum(spec.batch_size for spec in ld.schedule()[:start])
        for _, meta in batches:
            for t, key in enumerate(meta["keys"]):
                position = base + ld.cfg.rank + world * (cursor + t)
                assert position not in out
                out[position] = key
            cursor += meta["samples"]
    return out


@pytest.mark.parametrize("workers", [1, 2, 4, 7])
def test_batches_do_not_depend_on_the_workers(shards, workers):
    reference = run(loader(shards, workers=0))
    batches = run(loader(shards, workers=workers))
    assert [m["keys"] for _, m in batches] == [m["keys"] for _, m in reference]
    for (a, _), (b, _) in zip(batches, reference):  # bit for bit, so the gradients are too
        assert torch.equal(a["text"], b["text"])
        assert all(torch.equal(a["image"][k], b["image"][k]) for k in a["image"])


@pytest.mark.parametrize("world", [2, 3])
def test_every_world_size_reads_a_prefix_of_one_global_order(shards, world):
    ranks = [loader(shards, world=world, rank=r, workers=r % 2) for r in range(world)]
    got = seen(ranks)
    order = global_order(shards, 240)
    assert sorted(got) == list(range(len(got))) and 120 - world * 16 < len(got) <= 120  # a prefix: no gap or repeat
    assert [got[g] for g in range(len(got))] == order[:len(got)]
    assert len(set(got.values())) == len(got)


@pytest.mark.parametrize("after", [2, 3])
def test_a_resized_segment_continues_the_order_without_gap_or_repeat(shards, after):
    before = [loader(shards, world=2, rank=r, num_samples=200) for r in range(2)]
    stop = 3  # batches (steps, accum 1) the first segment ran, of 7 or so
    first = {}
    for ld in before:
        ld.set_epoch(0)
        for batch, meta in ld.iter_meta():
            if meta["index"] >= stop:
                break
            first.setdefault(ld.cfg.rank, []).append(meta)
    consumed = sum(m["samples"] for metas in first.values() for m in metas)
    tokens = 2 * sum(spec.batch_size * spec.seq_len for spec in before[0].schedule()[:stop])
    resumed = [loader(shards, world=after, rank=r, workers=1 + r % 2, num_samples=200) for r in range(after)]
    segment = resumed[0].resized(before[0].segment, stop, consumed, tokens)
    assert (segment.base, segment.first_step, segment.world_size) == (consumed, stop, after)
    assert 0 < segment.progress < 1
    rest = seen(resumed, segment)
    keys = [k for metas in first.values() for m in metas for k in m["keys"]] + list(rest.values())
    order = global_order(shards, 240)
    assert min(rest) == consumed and sorted(rest) == list(range(consumed, consumed + len(rest)))
    assert sorted(keys) == sorted(order[:len(keys)]) and len(set(keys)) == len(keys)
    assert 200 - after * 16 < len(keys) <= 200  # the epoch's --train-num-samples, within the last step
