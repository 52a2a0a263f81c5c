"""Reference bugs: small overrides of the step's hooks, in both modes, so checks can be seen to fail.

Invariant: each bug changes exactly one decision of a correct step (one hook), the same way in both modes
(``per-replay-scale``, ``logit-k-times``, ``no-rng-replay``, ``always-sync``; ``upstream-style`` the first three).
``bug_step(bug, mode)`` gives a step. docs/equivalence.md, "The bugs, shown red".
"""
from contextlib import nullcontext

from ..accum.cached_loss import CachedLossStep
from ..accum.replay import ReplayStep
from ..accum.scales import window_loss_scale
from ..accum.step import LOGIT_KEYS


class PerReplayScale:
    def replay_scale(self, window, j):
        # upstream: each replay takes the scale of a window of that one microbatch
        mb = window.microbatches[j]
        return window_loss_scale([mb.size], window.reference_batch_size, window.mode, naflex=mb.naflex)


class LogitKTimes:
    def logit_inputs(self, model_out, j, final):
        return {key: model_out[key] for key in LOGIT_KEYS if key in model_out}


class NoRngReplay:
    def replay_rng(self, microbatch):
        return nullcontext()


class AlwaysSync:
    def grad_sync(self, module, enabled):
        return nullcontext()


class UpstreamStyle(PerReplayScale, LogitKTimes, NoRngReplay):
    pass


BUGS = {"per-replay-scale": PerReplayScale, "logit-k-times": LogitKTimes, "no-rng-replay": NoRngReplay,
        "always-sync": AlwaysSync, "upstream-style": UpstreamStyle}
MODE_CLASSES = {"replay": ReplayStep, "cached-loss": CachedLossStep}


def bug_step(bug: str, mode: str):
    """A step of ``mode`` ('replay' or 'cached-loss') with reference bug ``bug`` (a key of BUGS)."""
    mixin, base = BUGS[bug], MODE_CLASSES[mode]
    cls = type(f"{mixin.__name__}{base.__name__}", (mixin, base), {})
    return cls()


# per_replay_scale_step ... upstream_style_step (replay mode, upstream's), and each one's *_cached_step
STEPS = {f"{bug.replace('-', '_')}{suffix}_step": bug_step(bug, mode)
         for bug in BUGS for mode, suffix in (("replay", ""), ("cached-loss", "_cached"))}
globals().update(STEPS)
__all__ = ["BUGS", "MODE_CLASSES", "bug_step", *STEPS]
