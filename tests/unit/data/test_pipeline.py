"""The train loader: batch format and sizes, rank/worker agreement, determinism, multi-worker runs."""

import pytest
import torch
from data_common import BUDGET, CharTokenizer, config, decode_text, demo, shard_paths

from naflex_accum.data import make_train_loader
from naflex_accum.data.assemble import assemble
from naflex_accum.data.samples import Corruption

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return demo(tmp_path_factory.mktemp("pipeline")).train


def check_batch(batch, spec, budget=BUDGET):
    assert set(batch) == {"image", "text"}
    image = batch["image"]
    assert set(image) == {"patches", "patch_coord", "patch_valid"}
    b, L = spec.batch_size, spec.seq_len
    p = spec.patch_size
    assert image["patches"].dtype == torch.uint8 and image["patches"].shape in ((b, L, p * p * 3), (b, L, p, p, 3))
    assert image["patch_coord"].dtype == torch.int64 and image["patch_coord"].shape == (b, L, 2)
    assert image["patch_valid"].dtype == torch.bool and image["patch_valid"].shape == (b, L)
    assert batch["text"].dtype == torch.int64 and batch["text"].shape[0] == b
    assert b * L <= budget
    valid = image["patch_valid"]
    counts = valid.sum(1)
    assert (counts > 0).all()
    # real patches first, zero padding after: padding is inert under the model's mask
    assert torch.equal(valid, torch.arange(L)[None] < counts[:, None])
    assert (image["patches"][~valid] == 0).all() and (image["patch_coord"][~valid] == 0).all()
    ys, xs = image["patch_coord"][..., 0], image["patch_coord"][..., 1]
    for i in range(b):
        m = int(counts[i])
        rows, cols = int(ys[i, :m].max()) + 1, int(xs[i, :m].max()) + 1
        assert rows * cols == m <= L  # a full grid of the resized image


def test_batches_follow_schedule(shards):
    loader = make_train_loader(config(shards, accum_freq=2), CharTokenizer())
    assert loader.num_batches % 2 == 0 and len(loader) == loader.num_batches
    specs = loader.schedule(0)
    batches = list(loader)
    assert len(batches) == loader.num_batches == len(specs)
    for batch, spec in zip(batches, specs):
        check_batch(batch, spec)
    assert loader.stats == {"epoch": 0, "batches": len(specs), "samples": sum(s.batch_size for s in specs),
                            "image_tokens": sum(int(b["image"]["patch_valid"].sum()) for b in batches),
                            "corrupt": 0, "standins": 0}
    assert 120 - 2 * 16 < loader.num_samples == sum(s.batch_size for s in specs) <= 120  # within a step of it
    assert all(c.startswith("a ") and c.endswith(" background") for b in batches for c in decode_text(b["text"]))


def test_ranks_agree_on_schedule_and_count(shards):
    loaders = [make_train_loader(config(shards, rank=r, world_size=3, num_samples=300), CharTokenizer())
               for r in range(3)]
    assert len({ld.num_batches for ld in loaders}) == 1
    assert len({ld.num_samples for ld in loaders}) == 1
    for epoch in (0, 1):
        assert all(ld.schedule(epoch) == loaders[0].schedule(epoch) for ld in loaders)
    firsts = []
    for ld in loaders:
        batches = list(ld)
        assert len(batches) == ld.num_batches
        firsts.append(decode_text(batches[0]["text"]))
    assert firsts[0] != firsts[1] != firsts[2]  # ranks read different samples


def test_simulated_workers_build_their_share_of_the_schedule(shards):
    loader = make_train_loader(config(shards, workers=3), CharTokenizer())
    specs = loader.schedule(0)
    parts = {}
    for worker in range(3):
        stream = loader.stream()  # what a DataLoader worker runs, driven directly
        indices = []
        for part, meta in stream._batches(worker):  # one part of every batch, in order
            indices.append(meta["index"])
            parts.setdefault(meta["index"], []).append((part, meta))
        assert indices == list(range(loader.num_batches))
    assert sorted(parts) == list(range(loader.num_batches))
    for index, pieces in parts.items():
        rows = sorted(row for _, meta in pieces for row in meta["rows"])
        assert rows == list(range(specs[index].batch_size))  # the workers' rows tile the batch
        batch, _ = assemble(pieces, specs[index].batch_size)
        check_batch(batch, specs[index])


def test_multiple_patch_sizes_are_unflattened(shards):
    loader = make_train_loader(config(shards, patch_sizes=(8, 16), seq_lens=(16, 64)), CharTokenizer())
    specs = loader.schedule(0)
    assert {s.patch_size for s in specs} == {8, 16}
    for batch, spec in zip(loader, specs):
        p = spec.patch_size
        assert batch["image"]["patches"].shape == (spec.batch_size, spec.seq_len, p, p, 3)
        check_batch(batch, spec)


def test_sample_reader_keeps_tar_order(shards):
    from naflex_accum.data.samples import shard_samples
    keys = [s.key for s in shard_samples(shard_paths(shards)[0], Corruption())]
    assert keys == sorted(keys) and len(keys) == 16


@pytest.mark.parametrize("flatten", [True, False])
def test_pil_path_matches_torch_path_layout(flatten):
    # The pipeline's uint8 path (PIL resize, one normalise per batch) lays patches out exactly as
    # naflex.image_to_patches does; only the resampling filter's round-off differs.
    import numpy as np
    from PIL import Image

    from naflex_accum.data.patches import collate_patches, image_to_patches
    from pillow_reference import collate_uint8_patches, pil_to_patches

    rng = np.random.default_rng(0)
    arrays = [(rng.random((h, w, 3)) * 60 + np.linspace(0, 180, w)[None, :, None]).astype(np.uint8)
              for h, w in ((40, 150), (96, 96), (200, 50))]
    ours = collate_uint8_patches([pil_to_patches(Image.fromarray(a), 36, 8, flatten) for a in arrays], 40)
    ref = collate_patches([image_to_patches(torch.from_numpy(a).permute(2, 0, 1).float() / 255, 36, 8,
                                            flatten=flatten) for a in arrays], 40)
    assert ours["patches"].shape == ref["patches"].shape == ((3, 40, 192) if flatten else (3, 40, 8, 8, 3))
    assert torch.equal(ours["patch_coord"], ref["patch_coord"]) and torch.equal(ours["patch_valid"], ref["patch_valid"])
    assert (ours["patches"] - ref["patches"]).abs().mean() < 0.05
    assert (ours["patches"][~ours["patch_valid"]] == 0).all()
