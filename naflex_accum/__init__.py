"""naflex-accum: exact gradient accumulation for OpenCLIP NaFlex CLIP and SigLIP training.

``train_step_eager`` is the drop-in for ``open_clip_train.train._train_step_eager``: the default
accumulation mode (``cached-loss``, the window loss once per window), the step that ``install()`` and
``naflex-accum train`` use unless told otherwise. ``replay_step`` is the other mode (the window loss
once per microbatch, as upstream). Importing this package changes nothing in open_clip or timm:
patching happens only when ``install()`` or ``patched()`` is called.
"""
from .accum.cached_loss import CachedLossStep, cached_loss_step
from .accum.replay import ReplayStep, replay_step
from .accum.scales import window_loss_scale
from .accum.step import AccumulationStep

# THE drop-in: the default mode's step itself (so its name, cached_loss_step, says which mode it is).
train_step_eager = cached_loss_step

__version__ = "0.1.0"

_PATCH_API = ("install", "uninstall", "patched", "is_installed", "PatchError")

__all__ = ["window_loss_scale", "train_step_eager", "cached_loss_step", "replay_step", "AccumulationStep",
           "CachedLossStep", "ReplayStep", *_PATCH_API, "__version__"]


def __getattr__(name):
    # The patch layer is imported on first use; importing it patches nothing.
    if name in _PATCH_API:
        from .upstream import patch  # lazy: `import naflex_accum` is the step alone, open_clip unimported
        return getattr(patch, name)
    raise AttributeError(f"module 'naflex_accum' has no attribute {name!r}")
