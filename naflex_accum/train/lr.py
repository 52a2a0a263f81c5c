"""Learning-rate schedules by optimizer step: open_clip's own ``cosine_lr`` and ``const_lr``.

Invariant: the rate is a pure function of the schedule position: open_clip's value at a whole step, and at a
fractional one (an elastic resume) the straight line between its neighbours, so never above ``--lr``.
"""
import math

from open_clip_train.scheduler import assign_learning_rate, const_lr, cosine_lr


def make_scheduler(optimizer, base_lr: float, warmup: int, total_steps: int, kind: str = "cosine"):
    """A callable ``scheduler(position)`` that sets every param group's lr and returns it."""
    curve = (const_lr if kind == "const" else cosine_lr)(optimizer, base_lr, warmup, total_steps)

    def scheduler(position: float) -> float:
        below = math.floor(position)
        if position == below:
            return curve(int(below))
        low = curve(below)
        # the run's last step has no step after it on the curve (open_clip's cosine is undefined there when the
        # warm-up takes every step): between them the rate holds
        high = curve(below + 1) if below + 1 < total_steps else low
        lr = low + (position - below) * (high - low)
        assign_learning_rate(optimizer, lr)
        return lr

    return scheduler
