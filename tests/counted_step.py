"""A training step seen from outside: every call counted and offered to a hook, nothing else changed.

Invariant: calling a ``CountedStep`` is calling the step it wraps (same arguments, same result), after
``before(calls)`` has run with the number of this call (1-based); ``window_scale`` is the wrapped step's own, so
the trainer's loop logs what it would have. The tests and their fault jobs (which put this folder on their path)
wrap ``train.main.select_step``'s step with it to count optimizer steps or to send a signal from inside a chosen
microbatch.
"""
from typing import Callable, Optional


class CountedStep:
    def __init__(self, step: Callable, before: Optional[Callable[[int], None]] = None):
        self.step, self.before = step, before
        self.calls = self.steps = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.before is not None:
            self.before(self.calls)
        result = self.step(*args, **kwargs)
        self.steps += result is not None
        return result

    @property
    def window_scale(self):
        return self.step.window_scale
