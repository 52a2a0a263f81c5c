import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

# Two-core CI machines: one thread is faster and steadier for tiny models, in this process and in every process
# the suite starts (a second OpenMP thread per process, with 3 to 4 test processes on 2 cores, spins for nothing).
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(__file__))
# Shard-size counts (data.index) go to a cache of the test session's own, inherited by its subprocesses and
# removed when it exits, so that no test run leaves one in the user's home or /tmp. torch.compile's kernels stay
# in torch's own cache ($TORCHINDUCTOR_CACHE_DIR, /tmp/torchinductor_$USER): warm, it saves minutes a run.
if "NAFLEX_ACCUM_CACHE" not in os.environ:
    _scratch = tempfile.mkdtemp(prefix="naflex-accum-test-cache-")
    atexit.register(shutil.rmtree, _scratch, ignore_errors=True)
    os.environ["NAFLEX_ACCUM_CACHE"] = _scratch
# The suite's subprocesses start as the default install does, without the optional wandb: where it is installed,
# timm imports it in every process that imports timm.data (half a CPU-second, a tenth of a trainer's start).
# test_wandb.py's runs have it.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parent / "no_wandb"),
                                                       os.environ.get("PYTHONPATH")]))


# The pinned upstream open_clip main snapshots, extracted once per run, and tiny demo shards for its trainer.
from upstream_real import demo_shards, pinned, upstream_src  # noqa: E402,F401
# Fixtures that put a stand-in upstream step on open_clip_train.train and restore it.
from upstream_stand_in import stand_in, upstream_train  # noqa: E402,F401


@pytest.fixture
def make_task():
    from naflex_accum.upstream.audit import default_task_factory
    return default_task_factory


# `make test` hands whole files to its workers in collection order (--dist loadfile --no-loadscope-reorder):
# the real SLURM first (the longest, mostly waiting on its daemons and jobs), then the longest others, measured on
# 2 cores, so that no worker is left alone with one of them at the end, then the rest of the integration tier,
# then the unit tier's short files to fill the gaps. Order within a file is kept.
LONGEST_FIRST = (  # the rest by CPU time, cold compile cache: 320-380 s, 210 s, 130 s, 120 s, 90-110 s
    "integration/test_slurm.py",
    "integration/test_compile.py",
    "integration/test_upstream_suite.py",
    "integration/test_fsdp.py",
    "integration/test_gpu_kit.py",
    "integration/test_runner_refusals.py",
)
TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items):
    def rank(item):
        path = item.path.relative_to(TESTS).as_posix() if item.path.is_relative_to(TESTS) else ""
        if path in LONGEST_FIRST:
            return 0, LONGEST_FIRST.index(path)
        return (1 if path.startswith("integration/") else 2), 0
    items.sort(key=rank)
