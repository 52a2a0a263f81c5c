import os
import sys

import pytest
import torch

# Two-core CI machines: one thread is faster and steadier for tiny models.
torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture
def make_task():
    from naflex_accum.audit import default_task_factory
    return default_task_factory
