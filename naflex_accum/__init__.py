"""naflex-accum: exact gradient accumulation for OpenCLIP NaFlex CLIP and SigLIP training.

Importing this package changes nothing in open_clip or timm: patching happens
only when ``install()`` or ``patched()`` is called.
"""
from .scales import window_loss_scale
from .step import AccumulationStep, train_step_eager

__version__ = "0.1.0"

__all__ = ["window_loss_scale", "train_step_eager", "AccumulationStep", "__version__"]
