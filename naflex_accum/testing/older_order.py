"""The accumulation step's older order of work, for benchmarks and tests that compare against it.

Invariant: the same gradients as the step it is mixed into (the equivalence tests run it), reached
the older way: every microbatch of a window is cached without grad as it arrives, the last one
included, then every one is replayed. It costs one forward more per window than the core step,
whose last microbatch's caching forward keeps its graph and serves as its replay.
"""
from ..accum.cached_loss import CachedLossStep
from ..accum.replay import ReplayStep
from ..accum.step import detach_values


class OlderOrder:
    """Mixin: put before an ``AccumulationStep`` subclass (``class Older(OlderOrder, CachedLossStep)``)."""

    def backward_window(self, task, window, cache, accum_batches, scaler, autocast):
        self.cache(task, accum_batches[-1], cache, autocast)
        state = self.prepare(task, window, cache, accum_batches, scaler, autocast)
        self.replay(task, window, state, accum_batches, range(len(accum_batches)), scaler, autocast)
        losses, report, spoken = state.result
        return detach_values(losses), detach_values(report), spoken


def older(step_class):
    """``step_class`` (an ``AccumulationStep`` subclass) with the older order of work."""
    return type(f"Older{step_class.__name__}", (OlderOrder, step_class), {})


OlderCachedLossStep, OlderReplayStep = older(CachedLossStep), older(ReplayStep)
