"""The learning-rate schedule (train/lr.py): open_clip's curve at whole steps, never above --lr between them."""
import pytest
import torch
from open_clip_train.scheduler import const_lr, cosine_lr

from naflex_accum.train.lr import make_scheduler


def optimizer():
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)


@pytest.mark.parametrize("kind,curve", [("cosine", cosine_lr), ("const", const_lr)])
def test_whole_steps_are_open_clips_values(kind, curve):
    ours, theirs = make_scheduler(optimizer(), 2e-3, 4, 20, kind), curve(optimizer(), 2e-3, 4, 20)
    assert [ours(s) for s in range(21)] == [theirs(s) for s in range(21)]


@pytest.mark.parametrize("kind", ["cosine", "const"])
def test_fractional_positions_stay_on_the_curve_and_under_the_rate(kind):
    opt = optimizer()
    schedule, reference = make_scheduler(opt, 2e-3, 4, 20, kind), make_scheduler(optimizer(), 2e-3, 4, 20, kind)
    for position in [0.5, 2.25, 3.333, 3.9, 4.5, 7.75, 19.5]:
        lr = schedule(position)
        low, high = reference(int(position)), reference(int(position) + 1)
        assert min(low, high) <= lr <= max(low, high) <= 2e-3, (position, lr)
        assert opt.param_groups[0]["lr"] == lr
    assert schedule(3.333) == pytest.approx(2e-3)  # open_clip's (step + 1) / warmup at 3.333 would give 0.002167


def test_a_fractional_position_in_the_last_step_holds_the_rate():
    # warm-up over every step: open_clip's cosine is undefined after the last one (0 steps of decay)
    schedule = make_scheduler(optimizer(), 2e-3, 8, 8, "cosine")
    assert schedule(7) == pytest.approx(2e-3) and schedule(7.5) == pytest.approx(2e-3)
