"""The global sample order (data.order): independent of the workers and the world size; resized segments."""

import pytest

from naflex_accum.data.order import Segment, batch_positions, check_slots, slot_worker
from naflex_accum.errors import UsageError

SLOTS = 6


def test_a_slots_positions_fall_to_one_rank_and_one_worker():
    from naflex_accum.data.slots import DataIndex, EpochOrder

    order = EpochOrder(DataIndex(["a", "b", "c"], [100, 37, 63]), 0, 0, SLOTS, 8, 16)
    for world in (1, 2, 3, 6):
        for base in (0, 7):
            seg = Segment(0, 10, world_size=world, slots=SLOTS, base=base)
            owner = {}
            for rank in range(world):
                for g in batch_positions(seg, rank, 0, 200 // world):
                    slot, q, _ = order.locate(g)
                    where = (rank, slot_worker(slot, world, 2))
                    assert owner.setdefault((slot, q), where) == where
    assert slot_worker(5, 2, 2) == 0 and slot_worker(3, 2, 2) == 1 and slot_worker(3, 2, 0) == 0


def test_slots_must_divide_between_the_ranks():
    assert check_slots(6, 3) == 6
    with pytest.raises(UsageError, match=r"--data-slots 4 is not a multiple of the world size 3"):
        check_slots(4, 3)
    with pytest.raises(UsageError, match="--data-slots must be a positive integer, got 0"):
        check_slots(0, 1)
