"""A rank that fails, freezes or is killed ends every rank of the run, in one line, in its exit class.

The real thing: torchrun (--standalone, gloo, CPU, 2 processes; each rank's output redirected by
torchrun to files of its own) around ``naflex-accum train`` (``loader_jobs/rank_faults.py``), and two
processes started the way srun starts them (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), where rank 0
serves the job's store from a process of its own. Faults: rank 1 alone raises (its data loader cannot
start, or its images stop decoding mid-run); rank 1 frozen with SIGSTOP; rank 1 killed with SIGKILL;
rank 1 frozen while rank 0 gets SIGTERM; rank 0 killed under srun; rank 0's checkpoint write slower
than any collective may wait. The line must reach the user once, on rank 0's stderr (and in out.log
once it exists); no rank may print a traceback or a connection error. Every subprocess has a timeout;
times are asserted only as generous bounds on a hang.
"""

import pytest


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf"])
def test_dist_timeout_must_be_seconds_above_0(value):
    from naflex_accum.errors import UsageError
    from naflex_accum.train.params import parse_args

    with pytest.raises(UsageError, match=r"--dist-timeout must be a number of seconds > 0"):
        parse_args(["--train-data", "x.tar", "--dist-timeout", value])
