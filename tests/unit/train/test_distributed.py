"""Multi-process: world set-up from torchrun/SLURM variables, and 2-process gloo runs on the CPU.

Every subprocess has a timeout, so a hung collective fails the test instead of CI.
"""

import pytest

from naflex_accum.errors import UsageError
from naflex_accum.ranks import LOCAL_RANK_VARS, RANK_VARS, WORLD_VARS, process_rank, slurm_master_addr, \
    slurm_master_port
from naflex_accum.train.ending.distributed import world_from_env
from naflex_accum.upstream.runner import _refused


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
    ({"PMI_SIZE": "2"}, r"PMI_SIZE is set but a rank \(PMI_RANK\) is not"),  # was (RANK or SLURM_PROCID)
    ({"SLURM_PROCID": "1"}, r"SLURM_PROCID is set but a world size \(SLURM_NTASKS\) is not"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, r"RANK=2 is not in \[0, WORLD_SIZE=2\)"),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "-3"}, "LOCAL_RANK=-3 is negative"),  # was taken
    ({"RANK": "0", "WORLD_SIZE": "-2"}, "WORLD_SIZE=-2: a world size is 1 or more"),  # named RANK=0
])
def test_half_set_environment_is_an_error(env, match):
    with pytest.raises(UsageError, match=match):
        world_from_env(env)


@pytest.fixture
def launched(monkeypatch):
    for name in (*RANK_VARS, *WORLD_VARS, *LOCAL_RANK_VARS):
        monkeypatch.delenv(name, raising=False)
    return lambda **env: [monkeypatch.setenv(k, v) for k, v in env.items()]


@pytest.mark.parametrize("env", [dict(RANK="+1", WORLD_SIZE="2"), dict(RANK="1_0", WORLD_SIZE="20"),
                                 dict(RANK=" 1", SLURM_PROCID="0", WORLD_SIZE="2"), dict(PMI_RANK="1", PMI_SIZE="2")])
def test_the_runner_and_the_trainer_agree_on_the_rank(launched, env):
    """The runner's rank-0-only messages and the trainer's world read the same variable the same way (the
    runner skipped a value that was not all digits: rank 0 to it, rank 1 to the trainer)."""
    launched(**env)
    assert process_rank() == world_from_env().rank != 0


def test_a_variable_that_is_no_integer_is_the_trainers_one_line_not_the_runners_traceback(launched):
    launched(RANK="\u00b2", WORLD_SIZE="\u00b2")  # str.isdigit() holds for it, int() refuses it
    assert process_rank() == 0 and type(_refused("a refusal", own_node=False)) is UsageError
    with pytest.raises(UsageError, match="RANK='\u00b2' is not an integer"):
        world_from_env()


@pytest.mark.parametrize("nodelist,head", [
    ("gpu[07-09,12],cpu3", "gpu07"), ("node001", "node001"), ("a[1-2]", "a1"), ("x-[003,005]", "x-003"),
])
def test_slurm_master_addr(nodelist, head):
    assert slurm_master_addr(nodelist) == head


def test_slurm_master_port_is_stable_and_in_range():
    assert slurm_master_port("123456") == slurm_master_port("123456")
    assert 10000 <= slurm_master_port("987654321") < 30000
