"""--dist-timeout, how long a collective waits on a peer (train/ending/distributed.py): seconds above 0, else one line.

The ranks themselves (a rank that fails, freezes or is killed: train/ending/liveness.py) run for real in
integration/test_rank_failures.py.
"""

import pytest


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf"])
def test_dist_timeout_must_be_seconds_above_0(value):
    from naflex_accum.errors import UsageError
    from naflex_accum.train.config.params import parse_args

    with pytest.raises(UsageError, match=r"--dist-timeout must be a number of seconds > 0"):
        parse_args(["--train-data", "x.tar", "--dist-timeout", value])
