"""Worker -> main process hand-over through recycled shared-memory slots: a batch still held is never overwritten."""

import pytest
import torch
from data_common import CharTokenizer, config, demo

from naflex_accum.data import delivery, handover, loader as loader_module, make_train_loader
from naflex_accum.data.assemble import assemble

torch.set_num_threads(1)

KEYS = ("patches", "patch_coord", "patch_valid")


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return demo(tmp_path_factory.mktemp("handover"), num=160).train


def _expected(loader):
    """The epoch's batches by index, built in this process as each worker builds its share."""
    parts = {}
    for worker in range(max(1, loader.cfg.workers)):
        for part, meta in loader.stream()._batches(worker):
            parts.setdefault(meta["index"], []).append((part, meta))
    specs = loader.schedule(0)
    return [assemble(parts[i], specs[i].batch_size)[0] for i in range(len(parts))]


def _equal(a, b):
    return torch.equal(a["text"], b["text"]) and all(torch.equal(a["image"][k], b["image"][k]) for k in KEYS)


@pytest.mark.parametrize("workers,max_slots", [(2, 2), (2, 16), (0, 2)])
def test_batches_held_to_the_end_of_the_epoch_keep_their_values(shards, monkeypatch, workers, max_slots):
    monkeypatch.setattr(handover, "MAX_SLOTS", max_slots)  # 2: slots fill, then fresh memory takes over
    loader = make_train_loader(config(shards, workers=workers, num_samples=150), CharTokenizer())
    held = list(loader)
    expected = _expected(loader)
    assert len(held) == len(expected) > 2 * 2  # more than two workers' two slots
    assert all(_equal(a, b) for a, b in zip(held, expected))


@pytest.mark.parametrize("workers", [0, 2])
def test_released_slots_are_reused_and_views_keep_theirs(shards, monkeypatch, workers):
    monkeypatch.setattr(handover, "MAX_SLOTS", 3)
    reused = []
    patches = handover.Receiver.patches

    def counting(self, ref):
        reused.append(ref.memory is None)
        return patches(self, ref)
    monkeypatch.setattr(handover.Receiver, "patches", counting)
    in_ring = []

    def assembling(parts, *args):
        in_ring.extend(m.get("ring") is not None for part, m in parts if part is not None)
        return assemble(parts, *args)
    monkeypatch.setattr(loader_module, "assemble", assembling)
    loader = make_train_loader(config(shards, workers=workers, num_samples=300), CharTokenizer())
    copies, views = [], {}
    for i, batch in enumerate(loader):
        copies.append({"text": batch["text"].clone(), "image": {k: v.clone() for k, v in batch["image"].items()}})
        if i in (1, 4):
            views[i] = batch["image"]["patches"][1:]  # as a training loop keeping a slice would
        del batch
    expected = _expected(loader)
    assert len(copies) == len(expected) > 4 * 2 * 3
    assert not loader.pin_memory  # a pinned loader does not recycle (see the last test)
    assert all(_equal(a, b) for a, b in zip(copies, expected))
    assert all(torch.equal(view, expected[i]["image"]["patches"][1:]) for i, view in views.items())
    # most parts travelled as a slot number (0 workers) or were written into the batch's ring buffer (2 workers,
    # see data.ring), not in new memory
    assert sum(reused) + sum(in_ring) >= len(expected) // 2 * max(1, workers)
    assert (sum(in_ring) > 0) == (workers >= 2)


def test_without_recycling_batches_travel_in_fresh_memory(shards, monkeypatch):
    # what a pinned (CUDA) loader's workers do: its pin thread copies each batch out at once

    received = []
    monkeypatch.setattr(handover.Receiver, "patches", lambda self, ref: received.append(ref))
    loader = make_train_loader(config(shards, workers=2, num_samples=150), CharTokenizer())
    stream = loader.stream()
    assert stream.recycle
    stream.recycle = False
    parts = {}
    for part, meta in delivery.iterate(delivery.torch_loader(stream, 2, False), False, handover.Receiver(stream.flags)):
        parts.setdefault(meta["index"], []).append((part, meta))
    specs = loader.schedule(0)
    batches = {i: assemble(pieces, specs[i].batch_size)[0] for i, pieces in parts.items()}
    expected = _expected(loader)
    assert received == [] and sorted(batches) == list(range(len(expected)))
    assert all(_equal(batches[i], b) for i, b in enumerate(expected))


@pytest.mark.parametrize("workers", [0, 1])
def test_the_training_process_never_freezes_its_heap(shards, workers):
    """Only loader workers freeze (``delivery.freeze_heap``): in the training process a frozen cycle would never
    be freed, and collecting first costs more than freezing saves. A cycle dropped before an epoch is freed."""
    import gc
    import weakref

    class Node:
        pass

    loader = make_train_loader(config(shards, workers=workers), CharTokenizer())
    frozen = gc.get_freeze_count()
    try:
        for epoch in range(2):
            cycle = Node()
            cycle.self = cycle
            alive = weakref.ref(cycle)
            del cycle
            loader.set_epoch(epoch)
            assert sum(meta["samples"] for _, meta in loader.iter_meta()) > 0
            assert gc.get_freeze_count() == frozen, f"epoch {epoch}: the training process froze its heap"
            gc.collect()
            assert alive() is None, f"epoch {epoch}: a cycle dropped before the epoch was never freed"
    finally:
        loader.close()
