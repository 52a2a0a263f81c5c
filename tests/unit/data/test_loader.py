"""--data-timeout, how long the loader waits for a batch: seconds >= 0 (0: no limit), else one line, exit 2.

Workers that die, raise or stop answering run for real in integration/test_loader_faults.py.
"""

import pytest


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "soon"])
def test_a_bad_data_timeout_is_one_line(value, capsys):
    from naflex_accum import cli

    assert cli.main(["train", "--train-data", "x.tar", "--data-timeout", value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--data-timeout" in err[0], err
