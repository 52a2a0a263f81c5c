"""naflex-accum: exact gradient accumulation for OpenCLIP NaFlex CLIP and SigLIP training.

``train_step_eager`` is the drop-in for ``open_clip_train.train._train_step_eager``: the default
accumulation mode (``cached-loss``, the window loss once per window), the step that ``install()`` and
``naflex-accum train`` use unless told otherwise. ``replay_step`` is the other mode (the window loss
once per microbatch, as upstream). Importing this package changes nothing in open_clip or timm:
patching happens only when ``install()`` or ``patched()`` is called. Nor does it import torch: each
name below loads its module on first use, so an entry point can make Ctrl-C one line (``interrupt``)
before torch's import starts, or any other import (the console script imports this package first).
"""
__version__ = "0.1.0"

# name -> (module, attribute); THE drop-in is the default mode's step itself (so its name says which mode)
_EXPORTS = {
    "window_loss_scale": (".accum.scales", "window_loss_scale"),
    "train_step_eager": (".accum.cached_loss", "cached_loss_step"),
    "cached_loss_step": (".accum.cached_loss", "cached_loss_step"),
    "CachedLossStep": (".accum.cached_loss", "CachedLossStep"),
    "replay_step": (".accum.replay", "replay_step"),
    "ReplayStep": (".accum.replay", "ReplayStep"),
    "AccumulationStep": (".accum.step", "AccumulationStep"),
    **{name: (".upstream.patch", name) for name in ("install", "uninstall", "patched", "is_installed", "PatchError")},
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name):
    if name in _EXPORTS:
        module, attribute = _EXPORTS[name]
        from importlib import import_module  # here, not at the top: the package imports nothing (see above)
        return getattr(import_module(module, __name__), attribute)
    raise AttributeError(f"module 'naflex_accum' has no attribute {name!r}")
