"""The accumulation modes and which one runs by default.

Invariant: every mode here is exact (the equivalence tests run over all), so the default is the fastest,
``cached-loss``; ``replay`` recomputes the loss per microbatch, as upstream. ``NAFLEX_ACCUM_MODE`` overrides the
default for the patched upstream step (docs/upstream.md, "Accumulation modes and ``NAFLEX_ACCUM_MODE``").
"""
import importlib
import os

from ..errors import UsageError

DEFAULT_MODE = "cached-loss"
ACCUM_MODES = ("cached-loss", "replay")
ENV_VAR = "NAFLEX_ACCUM_MODE"
# mode -> (module, function, class); looked up at call time, so the step is imported only when used.
STEPS = {"cached-loss": ("naflex_accum.accum.cached_loss", "cached_loss_step", "CachedLossStep"),
         "replay": ("naflex_accum.accum.replay", "replay_step", "ReplayStep")}


def resolve_mode(mode: str = None) -> str:
    """The mode a run uses: ``mode``, else $NAFLEX_ACCUM_MODE, else the default; unknown modes are refused."""
    mode = mode or os.environ.get(ENV_VAR) or DEFAULT_MODE
    if mode not in ACCUM_MODES:
        source = f"{ENV_VAR}={mode}" if mode == os.environ.get(ENV_VAR) else f"--accum-mode {mode}"
        raise UsageError(f"{source}: unknown accumulation mode; valid modes are {', '.join(ACCUM_MODES)}")
    return mode


def get_step(mode: str = None):
    """The step of ``mode`` (``None``: $NAFLEX_ACCUM_MODE, else the default); it follows the task's contract."""
    module, name, _ = STEPS[resolve_mode(mode)]
    return getattr(importlib.import_module(module), name)


def make_step(mode: str = None, contract=None):
    """A step of ``mode`` bound to ``contract`` (a ``contract.Contract``; ``None`` follows the task)."""
    module, _, cls = STEPS[resolve_mode(mode)]
    return getattr(importlib.import_module(module), cls)(contract)
