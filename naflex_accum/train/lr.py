"""Learning-rate schedules by optimizer step, as open_clip's ``cosine_lr`` and ``const_lr``.

Invariant: the rate is a pure function of the global optimizer step, so a
resumed run (which restores the step) follows the uninterrupted schedule.
"""
import math


def lr_at(step: int, base_lr: float, warmup: int, total_steps: int, kind: str = "cosine") -> float:
    if step < warmup:
        return base_lr * (step + 1) / warmup
    if kind == "const":
        return base_lr
    span = max(1, total_steps - warmup)
    progress = min(1.0, (step - warmup) / span)
    return 0.5 * (1 + math.cos(math.pi * progress)) * base_lr


def make_scheduler(optimizer, base_lr: float, warmup: int, total_steps: int, kind: str = "cosine"):
    """A callable ``scheduler(step)`` that sets every param group's lr and returns it."""
    def scheduler(step: int) -> float:
        lr = lr_at(step, base_lr, warmup, total_steps, kind)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr
    return scheduler
