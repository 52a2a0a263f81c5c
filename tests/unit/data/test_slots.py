"""data.slots: the parts of an epoch, the window shuffle, passes kept apart, positions located consistently."""
import numpy as np
import pytest

from naflex_accum.data.slots import DataIndex, EpochOrder, PassOrder, Piece, _cut, keep_apart, part_sizes, window_order
from naflex_accum.errors import UsageError

SIZES = [5, 40, 1, 0, 23, 11]


def _ids(pieces, index):
    return [int(index.offsets[p.shard]) + i for p in pieces for i in range(p.start, p.stop)]


def test_part_sizes_are_the_positions_of_each_slot_and_sum_to_the_whole():
    for total in (0, 1, 7, 80):
        for slots in (1, 3, 8, 100):
            sizes = part_sizes(total, slots)
            assert sum(sizes) == total and max(sizes) - min(sizes) <= 1
            assert sizes == [len(range(s, total, slots)) for s in range(slots)]


def test_cut_splits_the_pieces_in_reading_order_across_shard_boundaries():
    pieces = [Piece(2, 0, 4), Piece(0, 3, 10), Piece(1, 0, 1)]
    parts = _cut(pieces, [5, 3, 4])
    assert parts == [[Piece(2, 0, 4), Piece(0, 3, 4)], [Piece(0, 4, 7)], [Piece(0, 7, 10), Piece(1, 0, 1)]]


def test_the_parts_of_an_epoch_hold_every_sample_once():
    index = DataIndex([f"s{k}" for k in range(len(SIZES))], SIZES)
    for slots in (1, 4, 7):
        order = EpochOrder(index, seed=3, epoch=1, slots=slots, window=4, tail=1)
        held = [_ids(part, index) for part in order.parts]
        assert sorted(i for part in held for i in part) == list(range(index.total))
        assert [len(part) for part in held] == part_sizes(index.total, slots)


def test_window_order_shuffles_only_within_windows_and_is_seeded():
    emit = window_order(23, 5, np.random.RandomState(0))
    assert sorted(emit.tolist()) == list(range(23))
    assert all(emit[j] // 5 == j // 5 for j in range(23)) and emit.tolist() != list(range(23))
    assert emit.tolist() == window_order(23, 5, np.random.RandomState(0)).tolist()
    assert window_order(6, 1, np.random.RandomState(0)).tolist() == list(range(6))


def test_keep_apart_moves_the_previous_tail_out_of_the_first_emissions():
    index = DataIndex(["a"], [8])
    previous = PassOrder(index, [Piece(0, 0, 8)], np.arange(8))  # last two emissions: samples 6, 7
    order = PassOrder(index, [Piece(0, 0, 8)], np.array([7, 6, 0, 1, 2, 3, 4, 5]))
    keep_apart(order, previous, 2, "--train-data")
    ids = order.ids(np.arange(8)).tolist()
    assert sorted(ids) == list(range(8)) and not {6, 7} & set(ids[:2])
    assert ids == [0, 1, 7, 6, 2, 3, 4, 5]
    with pytest.raises(UsageError, match=r"--train-data: a slot's part \(8 samples\) is shorter than two batches"):
        keep_apart(order, previous, 5, "--train-data")


def test_locate_and_emissions_agree_and_the_order_is_a_function_of_its_inputs():
    index = DataIndex([f"s{k}" for k in range(len(SIZES))], SIZES)
    order = EpochOrder(index, seed=5, epoch=2, slots=3, window=4, tail=2)
    total = index.total
    seen = {}
    for g in range(2 * total):
        slot, q, j = order.locate(g)
        seen.setdefault(slot, []).append((q, j))
    for slot in range(3):
        ranges = order.emissions(slot, 0, 2 * total)
        assert [(q, j) for q, a, b in ranges for j in range(a, b)] == seen[slot]
    again = EpochOrder(index, seed=5, epoch=2, slots=3, window=4, tail=2)
    other = EpochOrder(index, seed=5, epoch=3, slots=3, window=4, tail=2)
    first = [int(order.order(0, 1).ids([j])[0]) for j in range(10)]
    assert first == [int(again.order(0, 1).ids([j])[0]) for j in range(10)]
    assert first != [int(other.order(0, 1).ids([j])[0]) for j in range(10)]


def test_resampled_rounds_draw_only_the_slots_own_part():
    index = DataIndex([f"s{k}" for k in range(4)], [10, 10, 10, 10], sources=[0, 0, 1, 1],
                      weights=[1.0, 1.0, 0.0, 0.0])
    order = EpochOrder(index, seed=0, epoch=0, slots=2, window=3, tail=1, resampled=True)
    for slot in range(2):
        own = set(_ids(order.parts[slot], index))
        drawn = {int(order.order(*order.locate(g)[:2]).ids([order.locate(g)[2]])[0])
                 for g in range(slot, 200, 2)}
        assert drawn <= own and drawn.isdisjoint(range(20, 40))  # source 1 has factor 0: never drawn
        stream = [order.locate(g)[1:] for g in range(slot, 200, 2)]  # the slot's emissions, round after round
        assert stream[0] == (0, 0) and all(b == (a[0], a[1] + 1) or b == (a[0] + 1, 0)
                                           for a, b in zip(stream, stream[1:]))
        assert [(q, j) for q, a, b in order.emissions(slot, 0, 200) for j in range(a, b)] == stream
