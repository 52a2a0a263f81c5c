"""Mid-epoch resume without decoding the skipped part, persistent pinned workers, and resampled shard streams."""

import collections

import pytest
import torch
from data_common import CharTokenizer, config, decode_text, demo, shard_paths, tar_members

from naflex_accum.data import make_train_loader
from naflex_accum.errors import UsageError

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return demo(tmp_path_factory.mktemp("resume")).train


def same(a, b):
    return len(a) == len(b) and all(
        torch.equal(x["text"], y["text"]) and all(torch.equal(x["image"][k], y["image"][k]) for k in x["image"])
        for x, y in zip(a, b))


def epoch(loader, number, start=0):
    loader.set_epoch(number, start)
    return list(loader)


def test_skipped_batches_are_not_decoded_tokenized_or_collated(shards, monkeypatch):
    import naflex_accum.data.pipeline as pipeline

    calls = collections.Counter()

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        monkeypatch.setattr(pipeline, name, wrapper)
    for name in ("decode_for_seq", "patchify_into"):
        counted(name, getattr(pipeline, name))

    class CountingTokenizer(CharTokenizer):
        def __call__(self, texts):
            calls["tokenize"] += 1
            return super().__call__(texts)

    loader = make_train_loader(config(shards, num_samples=160), CountingTokenizer())
    start = loader.num_batches - 2
    batches = epoch(loader, 0, start)
    decoded = sum(b["text"].shape[0] for b in batches)
    assert len(batches) == 2 and calls == {"decode_for_seq": decoded, "patchify_into": decoded, "tokenize": 2}


def test_resampled_rounds_draw_pieces_with_replacement_by_weight(shards):
    from naflex_accum.data.index import shard_sizes
    from naflex_accum.data.slots import DataIndex, EpochOrder

    urls = shard_paths(shards)
    weights = [3.0, 1.0, 0.0, 1.0, 1.0, 1.0]
    index = DataIndex(urls, shard_sizes(urls), list(range(len(urls))), weights)
    order = EpochOrder(index, 0, 0, 2, 8, 16, resampled=True)
    draws = collections.Counter(p.shard for q in range(600) for p in order.order(1, q).pieces)
    assert 2 not in draws and abs(draws[0] / draws[1] - 3) < 0.4
    again = EpochOrder(index, 0, 0, 2, 8, 16, resampled=True)
    assert again.order(1, 5).pieces == order.order(1, 5).pieces                   # seeded by (seed, epoch, slot)
    assert order.order(0, 5).pieces != order.order(1, 5).pieces
    parts = [{p.shard for p in part} for part in order.parts]
    assert all(len(part) == len(urls) for part in parts)  # every source cut across the slots alike


def test_resampled_loader_is_deterministic_and_honours_factors(shards, tmp_path):
    paths = shard_paths(shards)
    spec = f"{paths[0]}::{paths[1]}::{paths[2]}"
    run = [epoch(make_train_loader(config(spec, dataset_resampled=True, workers=w), CharTokenizer()), 2)
           for w in (0, 0)]
    assert same(*run)
    only_second = make_train_loader(config(spec, dataset_resampled=True, upsampling_factors=(0, 1, 0),
                                           num_samples=40), CharTokenizer())
    captions = {c for b in epoch(only_second, 0) for c in decode_text(b["text"])}
    allowed = {d.decode() for n, d in tar_members(paths[1]) if n.endswith(".txt")}
    assert captions <= allowed
    assert same(epoch(only_second, 0), epoch(make_train_loader(
        config(spec, dataset_resampled=True, upsampling_factors="0::1::0", num_samples=40), CharTokenizer()), 0))


@pytest.mark.parametrize("kw,match", [
    (dict(dataset_resampled=False, upsampling_factors=(1, 2)),
     r"--train-data-upsampling-factors needs --dataset-resampled"),
    (dict(dataset_resampled=True, upsampling_factors=(1,)),
     r"--train-data-upsampling-factors \(1,\) has 1 factors but --train-data has 2 '::'-joined sources"),
    (dict(dataset_resampled=True, upsampling_factors=(1, -1)), r"finite, >= 0, and not all 0"),
    (dict(dataset_resampled=True, upsampling_factors=(0, 0)), r"not all 0"),
    (dict(dataset_resampled=True, upsampling_factors=(1, float("nan"))), r"finite"),
    (dict(dataset_resampled=True, upsampling_factors="1::x"), r"give numbers joined by '::'"),
])
def test_bad_upsampling_factors(shards, kw, match):
    paths = shard_paths(shards)
    with pytest.raises(UsageError, match=match) as info:
        make_train_loader(config(f"{paths[0]}::{paths[1]}", **kw), CharTokenizer())
    assert "\n" not in str(info.value)


