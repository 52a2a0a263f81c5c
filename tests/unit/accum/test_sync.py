"""accum.sync: no gradient all-reduce inside grad_sync(module, False), sync back on afterwards (FSDP2's way first)."""
from contextlib import nullcontext

import pytest
import torch

from naflex_accum.accum.sync import grad_sync


class FSDPLike(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = []

    def set_requires_gradient_sync(self, value):
        self.calls.append(value)


def test_fsdp2_sync_is_off_inside_and_back_on_after_even_on_error():
    module = FSDPLike()
    with grad_sync(module, False):
        assert module.calls == [False]
    assert module.calls == [False, True]
    with pytest.raises(RuntimeError):
        with grad_sync(module, False):
            raise RuntimeError("backward failed")
    assert module.calls[-1] is True


def test_enabled_or_a_plain_module_changes_nothing():
    module = FSDPLike()
    with grad_sync(module, True):
        pass
    assert module.calls == [] and isinstance(grad_sync(module, True), nullcontext)
    assert isinstance(grad_sync(torch.nn.Linear(1, 1), False), nullcontext)
