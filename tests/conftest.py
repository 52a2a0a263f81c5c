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
# Shard-size counts (data.index) and torch.compile's kernels go to caches of the test process's own, inherited
# by its subprocesses and removed when it exits, so that no test run leaves them in the user's home or /tmp.
if "NAFLEX_ACCUM_CACHE" not in os.environ:
    _scratch = tempfile.mkdtemp(prefix="naflex-accum-test-cache-")
    atexit.register(shutil.rmtree, _scratch, ignore_errors=True)
    os.environ["NAFLEX_ACCUM_CACHE"] = os.path.join(_scratch, "shards")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(_scratch, "inductor"))


# The pinned upstream open_clip main snapshots, extracted once per run, and tiny demo shards for its trainer.
from upstream_real import demo_shards, pinned, upstream_src  # noqa: E402,F401
# Fixtures that put a stand-in upstream step on open_clip_train.train and restore it.
from upstream_stand_in import stand_in, upstream_train  # noqa: E402,F401


@pytest.fixture
def make_task():
    from naflex_accum.upstream.audit import default_task_factory
    return default_task_factory
