"""naflex-accum: exact gradient accumulation for OpenCLIP NaFlex CLIP and SigLIP training.

Importing this package changes nothing in open_clip or timm: patching happens
only when ``install()`` or ``patched()`` is called.
"""
from .cached_loss import CachedLossStep, cached_loss_step
from .scales import window_loss_scale
from .step import AccumulationStep, train_step_eager

__version__ = "0.1.0"

_PATCH_API = ("install", "uninstall", "patched", "is_installed", "PatchError")

__all__ = ["window_loss_scale", "train_step_eager", "cached_loss_step", "AccumulationStep", "CachedLossStep",
           *_PATCH_API, "__version__"]


def __getattr__(name):
    # The patch layer is imported on first use; importing it patches nothing.
    if name in _PATCH_API:
        from . import patch
        return getattr(patch, name)
    raise AttributeError(f"module 'naflex_accum' has no attribute {name!r}")
