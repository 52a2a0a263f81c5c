"""Worker -> main process hand-over through recycled shared-memory slots: a batch still held is never overwritten."""

import torch
from torch.utils.data._utils.pin_memory import pin_memory

from naflex_accum.data import handover

torch.set_num_threads(1)


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
