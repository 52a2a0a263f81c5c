"""The console script: which process ends with the run is passed down from the entry point, never set globally."""
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from naflex_accum import cli
from naflex_accum.train import main as train_main
from naflex_accum.train.preempt import StopRequest


@pytest.fixture
def seen_by_run(monkeypatch, tmp_path):
    """What ``train.main.run`` is given, with the run itself replaced by a finished one."""
    seen = []

    def fake_run(args, world, device, ends_process=False):
        seen.append(ends_process)
        return {"exit_code": 0, "run_folder": str(tmp_path)}
    monkeypatch.setattr(train_main, "run", fake_run)
    monkeypatch.setattr(train_main, "print_footer", lambda result: None)
    monkeypatch.delenv("NAFLEX_ACCUM_EXIT_FILE", raising=False)
    return seen


def test_only_the_entry_point_says_the_process_ends_with_the_run(seen_by_run):
    argv = ["train", "--train-data", "x-{000000..000001}.tar", "--device", "cpu"]
    before = signal.getsignal(signal.SIGINT)
    try:
        assert cli.entry(argv) == 0
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # the command returned: a late Ctrl-C changes nothing
        signal.signal(signal.SIGINT, before)
        assert cli.main(argv) == 0
        assert signal.getsignal(signal.SIGINT) is before  # in-process callers keep their own Ctrl-C
    finally:
        signal.signal(signal.SIGINT, before)
    assert seen_by_run == [True, False]


def test_a_stop_request_leaves_the_signals_ignored_only_where_the_process_ends():
    world = SimpleNamespace(is_master=True)
    before = signal.getsignal(signal.SIGTERM)
    try:
        StopRequest(Path("STOP"), world).close()
        assert signal.getsignal(signal.SIGTERM) is before
        StopRequest(Path("STOP"), world, ends_process=True).close()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, before)


def test_the_exit_file_holds_the_status_and_the_line_the_process_ended_with(monkeypatch, tmp_path, seen_by_run):
    """A cluster script reads the trainer's own status (torchrun exits 1 whatever it was) and prints the line."""
    path = tmp_path / "exit"
    monkeypatch.setenv("NAFLEX_ACCUM_EXIT_FILE", str(path))
    assert cli.entry(["train", "--train-data", "x-{000000..000001}.tar", "--device", "cpu"]) == 0
    assert path.read_text() == "0\n"
    assert cli.entry(["train"]) == 2
    status, line = path.read_text().splitlines()
    assert status == "2" and line == "naflex-accum train: error: --train-data is required: webdataset shards, e.g. " \
                                     "'data/train-{0000..0009}.tar'"

    def bug(*args, **kwargs):
        raise ValueError("boom\nsecond line")
    monkeypatch.setattr(train_main, "run", bug)
    with pytest.raises(ValueError):
        cli.entry(["train", "--train-data", "x-{000000..000001}.tar", "--device", "cpu"])
    assert path.read_text() == "1\nValueError: boom (a bug: the traceback is in the output)\n"
