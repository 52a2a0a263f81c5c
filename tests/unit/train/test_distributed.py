"""Multi-process: world set-up from torchrun/SLURM variables, and 2-process gloo runs on the CPU.

Every subprocess has a timeout, so a hung collective fails the test instead of CI.
"""

import pytest

from naflex_accum.errors import UsageError
from naflex_accum.ranks import slurm_master_addr, slurm_master_port
from naflex_accum.train.ending.distributed import world_from_env


def test_torchrun_variables():
    w = world_from_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"})
    assert (w.rank, w.world_size, w.local_rank, w.distributed, w.is_master) == (3, 4, 1, True, False)
    assert not world_from_env({}).distributed


def test_slurm_variables_and_precedence():
    slurm = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1"}
    w = world_from_env(slurm)
    assert (w.rank, w.world_size, w.local_rank) == (5, 8, 1)
    # torchrun inside a SLURM allocation: torchrun's own variables win, as in open_clip
    w = world_from_env({**slurm, "RANK": "0", "WORLD_SIZE": "16", "LOCAL_RANK": "0"})
    assert (w.rank, w.world_size, w.local_rank) == (0, 16, 0)


@pytest.mark.parametrize("env,match", [
    ({"RANK": "1"}, "RANK is set but a world size"),
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE is set but a rank"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, r"RANK=2 is not in \[0, WORLD_SIZE=2\)"),
])
def test_half_set_environment_is_an_error(env, match):
    with pytest.raises(UsageError, match=match):
        world_from_env(env)


@pytest.mark.parametrize("nodelist,head", [
    ("gpu[07-09,12],cpu3", "gpu07"), ("node001", "node001"), ("a[1-2]", "a1"), ("x-[003,005]", "x-003"),
])
def test_slurm_master_addr(nodelist, head):
    assert slurm_master_addr(nodelist) == head


def test_slurm_master_port_is_stable_and_in_range():
    assert slurm_master_port("123456") == slurm_master_port("123456")
    assert 10000 <= slurm_master_port("987654321") < 30000
