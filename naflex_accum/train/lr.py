"""Learning-rate schedules by optimizer step: open_clip's own ``cosine_lr`` and ``const_lr``.

Invariant: the rate is a pure function of the global optimizer step, so a
resumed run (which restores the step) follows the uninterrupted schedule.
"""


def make_scheduler(optimizer, base_lr: float, warmup: int, total_steps: int, kind: str = "cosine"):
    """A callable ``scheduler(step)`` that sets every param group's lr and returns it (open_clip's)."""
    from open_clip_train.scheduler import const_lr, cosine_lr

    return (const_lr if kind == "const" else cosine_lr)(optimizer, base_lr, warmup, total_steps)
