"""Gradient-sync control for accumulation replays.

Invariant: inside ``grad_sync(module, False)`` a backward does not all-reduce
(DDP ``no_sync()``, FSDP2 ``set_requires_gradient_sync(False)``), and on exit
sync is back on, so only the window's last backward communicates. The checks
follow upstream open_clip's order: FSDP2's method first, then DDP.
"""
from contextlib import contextmanager, nullcontext

from torch.nn.parallel import DistributedDataParallel


@contextmanager
def _fsdp_no_sync(module):
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


def grad_sync(module, enabled: bool):
    """Context in which backward passes sync gradients only if ``enabled``."""
    if enabled:
        return nullcontext()
    if hasattr(module, "set_requires_gradient_sync"):
        return _fsdp_no_sync(module)
    if isinstance(module, DistributedDataParallel):
        return module.no_sync()
    return nullcontext()
