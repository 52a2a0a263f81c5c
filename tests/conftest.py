import atexit
import os
import shutil
import sys
import tempfile

import pytest
import torch

# Two-core CI machines: one thread is faster and steadier for tiny models.
torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(__file__))
# Shard-size counts (data.index) go to a cache of the test session's own, inherited by its subprocesses and
# removed when it exits, so that no test run leaves one in the user's home or /tmp. torch.compile's kernels stay
# in torch's own cache ($TORCHINDUCTOR_CACHE_DIR, /tmp/torchinductor_$USER): warm, it saves minutes a run.
if "NAFLEX_ACCUM_CACHE" not in os.environ:
    _scratch = tempfile.mkdtemp(prefix="naflex-accum-test-cache-")
    atexit.register(shutil.rmtree, _scratch, ignore_errors=True)
    os.environ["NAFLEX_ACCUM_CACHE"] = _scratch


# The pinned upstream open_clip main snapshots, extracted once per run, and tiny demo shards for its trainer.
from upstream_real import demo_shards, pinned, upstream_src  # noqa: E402,F401
# Fixtures that put a stand-in upstream step on open_clip_train.train and restore it.
from upstream_stand_in import stand_in, upstream_train  # noqa: E402,F401


@pytest.fixture
def make_task():
    from naflex_accum.upstream.audit import default_task_factory
    return default_task_factory
