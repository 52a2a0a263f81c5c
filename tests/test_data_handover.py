"""Worker -> main process hand-over through recycled shared-memory slots: a batch still held is never overwritten."""
import pytest
import torch
from torch.utils.data._utils.pin_memory import pin_memory

from naflex_accum.data.assemble import assemble
from naflex_accum.data import delivery, handover, make_train_loader
from naflex_accum.data import loader as loader_module
from test_data_common import CharTokenizer, config, demo

torch.set_num_threads(1)
KEYS = ("patches", "patch_coord", "patch_valid")


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return demo(tmp_path_factory.mktemp("handover"), num=160).train


def _sender(slots, receive):
    def send(values):
        out = slots.alloc(values.numel())
        out.copy_(values.flatten())
        n = values.shape[0]
        batch = {"image": {"patches": out.view(values.shape), "patch_coord": torch.zeros(n, 2, dtype=torch.long),
                           "patch_valid": torch.ones(n, dtype=torch.bool)}, "text": torch.zeros(n, 3, dtype=torch.long)}
        packed, _ = slots.pack((batch, {"index": 0}))
        return packed["image"]["patches"], receive(packed)["image"]["patches"]
    return send


def test_a_slot_is_reused_only_when_no_tensor_is_over_it(monkeypatch):
    monkeypatch.setattr(handover, "MAX_SLOTS", 3)
    flags = handover.new_flags(1)
    send = _sender(handover.WorkerSlots(flags, 0), handover.Receiver(flags))
    ref, a = send(torch.full((2, 3), 1.0))
    assert isinstance(ref, handover.SlotRef) and ref.slot == 0 and ref.memory is not None
    assert pin_memory(ref) is ref  # the DataLoader's pin thread leaves the slot's memory alone
    ref, b = send(torch.full((2, 3), 2.0))
    assert ref.slot == 1  # slot 0 is held by `a`
    view = a[1]
    del a
    ref, c = send(torch.full((2, 3), 3.0))
    assert ref.slot == 2  # a view alone keeps slot 0
    del view, b
    ref, d = send(torch.full((2, 3), 4.0))
    assert (ref.slot, ref.generation, ref.memory) == (0, 0, None)  # reused; its memory is not sent again
    ref, e = send(torch.full((4, 3), 5.0))
    assert (ref.slot, ref.generation) == (1, 1) and ref.memory is not None  # free but too small: it grew
    ref, f = send(torch.full((2, 3), 6.0))
    assert not isinstance(ref, handover.SlotRef)  # every slot held: fresh shared memory, as before
    assert all(t.dtype == torch.uint8 for t in (c, d, e, f))  # patch memory: the loader hands over uint8
    assert [float(t.float().mean()) for t in (c, d, e, f)] == [3.0, 4.0, 5.0, 6.0]
    assert list(flags[0].tolist()) == [1, 1, 1]
    del c, d, e
    assert list(flags[0].tolist()) == [0, 0, 0]


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


def test_the_assembly_pool_reuses_a_buffer_only_when_nothing_holds_it():
    from naflex_accum.data.assemble import Pool

    pool = Pool(keep=2)
    a = pool.empty((4, 8))
    a.fill_(1.0)
    address = a.data_ptr()
    view = a[2:]
    del a
    b = pool.empty((4, 8))
    assert b.data_ptr() != address  # a view alone keeps the buffer
    del view
    c = pool.empty((3, 8))
    assert c.data_ptr() == address  # free again, and big enough (within 2x)
    del b, c
    assert pool.empty((64, 8)).shape == (64, 8) and len(pool.free) <= 2  # too small ones stay, at most `keep`


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
