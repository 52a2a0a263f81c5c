"""A data-loader worker that dies, raises or stops answering ends the run promptly, in one line, exit 74.

The real thing in a subprocess (``loader_jobs/faulty_trainer.py`` around ``naflex-accum
train``): a worker killed with SIGKILL (what the OOM killer sends), over both hand-over
paths (recycled shared-memory slots, fresh shared memory) with 1 and 2 workers (and a worker
killed while its batch is read, before it can be reaped: ``loader_jobs/lost_mid_read.py``); a worker
that raises; a worker frozen with SIGSTOP under ``--data-timeout``. Each run must exit 74
within seconds with one error line naming the worker, print no traceback, and leave its
last checkpoint loadable. Every subprocess has a timeout.
"""

import pytest


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "soon"])
def test_a_bad_data_timeout_is_one_line(value, capsys):
    from naflex_accum import cli

    assert cli.main(["train", "--train-data", "x.tar", "--data-timeout", value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--data-timeout" in err[0], err
