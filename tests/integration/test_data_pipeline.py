"""The train loader: batch format and sizes, rank/worker agreement, determinism, multi-worker runs."""

import pytest
import torch
from data_common import CharTokenizer, config, shard_paths
from unit.data.test_pipeline import check_batch, shards  # noqa: F401 (fixtures)

from naflex_accum.data import make_train_loader

torch.set_num_threads(1)


def test_two_workers_yield_exactly_num_batches_in_order(shards):
    from open_clip.tokenizer import SimpleTokenizer

    loader = make_train_loader(config(shards, workers=2, num_samples=150), SimpleTokenizer(context_length=32))
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        specs = loader.schedule(epoch)
        batches = list(loader)
        assert len(batches) == loader.num_batches == loader.stats["batches"]
        for batch, spec in zip(batches, specs):
            check_batch(batch, spec)
            assert batch["text"].shape[1] == 32
        assert loader.stats["samples"] == sum(s.batch_size for s in specs)


def test_epoch_is_pure_function_of_seed_epoch_rank(shards):
    def run(epoch, **kw):
        loader = make_train_loader(config(shards, **kw), CharTokenizer())
        loader.set_epoch(epoch)
        return list(loader)

    def same(a, b):
        return len(a) == len(b) and all(torch.equal(x["text"], y["text"]) and
                                        torch.equal(x["image"]["patches"], y["image"]["patches"])
                                        for x, y in zip(a, b))

    once = run(1)
    assert same(once, run(1))                          # a resumed run sees the same epoch
    assert not same(once, run(2))
    assert not same(once, run(1, seed=5))
    assert same(run(1, workers=2), run(1, workers=2))  # worker interleaving is deterministic too


def test_stream_does_not_depend_on_batch_size(shards):
    # One sequence length: budget T with accum 2 vs 2T with accum 1 -> batch i at 2T == batches 2i, 2i+1 at T.
    def run(budget, accum, workers):
        cfg = config(shards, seq_lens=(36,), max_tokens_per_batch=budget, accum_freq=accum, num_samples=100,
                     workers=workers)
        return list(make_train_loader(cfg, CharTokenizer()))

    small, large = run(36 * 4, 2, 0), run(36 * 8, 1, 0)
    assert len(small) == 2 * len(large)
    for i, big in enumerate(large):
        a, b = small[2 * i], small[2 * i + 1]
        assert torch.equal(big["text"], torch.cat([a["text"], b["text"]]))
        for key in big["image"]:
            assert torch.equal(big["image"][key], torch.cat([a["image"][key], b["image"][key]]))
    one_worker = run(36 * 8, 1, 1)  # a single DataLoader worker reads the same stream as the main process
    assert all(torch.equal(x["image"]["patches"], y["image"]["patches"]) for x, y in zip(large, one_worker))


def test_pipe_urls_and_joined_sources(shards, tmp_path):
    paths = shard_paths(shards)
    spec = f"pipe:cat {paths[0]}::{paths[1]}::pipe:cat {paths[2]}"
    loader = make_train_loader(config(spec, num_samples=40), CharTokenizer())
    assert len(loader.index.urls) == 3
    assert len(list(loader)) == loader.num_batches and loader.stats["corrupt"] == 0


@pytest.mark.parametrize("workers,patch_sizes", [(0, (16,)), (2, (16,)), (0, (8, 16))])
def test_the_task_normalises_the_loaders_uint8_patches(shards, workers, patch_sizes):
    # The loader hands over uint8 patches; the task's prepare_batch (on the training device) must make exactly the
    # normalised float batch, padding exactly zero (not -0.0), in any dtype asked.
    from naflex_accum.data.patches import IMAGE_MEAN, IMAGE_STD
    from naflex_accum.tasks import ContrastiveTask

    seq_lens = (16, 36) if len(patch_sizes) == 1 else (16, 64)
    loader = make_train_loader(config(shards, workers=workers, num_samples=60, seq_lens=seq_lens,
                                      patch_sizes=patch_sizes), CharTokenizer())
    task = ContrastiveTask(torch.nn.Identity(), None)
    mean, std = torch.tensor(IMAGE_MEAN), torch.tensor(IMAGE_STD)
    for batch, meta in loader.iter_meta():
        raw = batch["image"]["patches"]
        assert raw.dtype == torch.uint8
        image = task.prepare_batch(batch, "cpu")["image"]
        valid = image["patch_valid"]
        patches = image["patches"]
        assert patches.dtype == torch.float32 and patches.shape == raw.shape
        assert (patches[~valid] == 0).all() and not torch.signbit(patches[~valid]).any()
        pixels = raw.reshape(*raw.shape[:2], -1, 3).float() / 255
        expected = ((pixels - mean) / std).view(raw.shape) * valid.view(valid.shape + (1,) * (raw.dim() - 2))
        assert torch.allclose(patches, expected, atol=1e-6, rtol=0)
        half = task.prepare_batch(batch, "cpu", torch.bfloat16)["image"]["patches"]
        assert half.dtype == torch.bfloat16 and torch.equal(half, patches.to(torch.bfloat16))
