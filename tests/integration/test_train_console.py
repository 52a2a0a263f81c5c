"""What `naflex-accum train` tells its user: log lines and the progress bar on a terminal never share a line, a
finished run ends with a summary (console and out.log), a resume of a finished run says there is nothing to do,
and a note says when the sequence lengths were taken in another order than given."""
import errno
import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from naflex_accum.cli import main as cli_main
from naflex_accum.data import write_demo_data

ROOT = Path(__file__).resolve().parents[2]
RECORD = re.compile(r"\d{4}-\d\d-\d\d,\d\d:\d\d:\d\d \| [A-Z]+ \| ")
CSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_demo_data(tmp_path_factory.mktemp("demo") / "data", num_samples=64, val_samples=16, seed=0,
                           processes=1)


def argv(shards, logs, name, *extra):
    return ["--train-data", shards.train, "--model", "naflex-tiny", "--naflex-seq-lens", "16",
            "--naflex-max-tokens-per-batch", "128", "--naflex-batch-divisor", "1", "--train-num-samples", "64",
            "--epochs", "1", "--workers", "0", "--device", "cpu", "--lr", "1e-3", "--warmup", "1",
            "--logs", str(logs), "--name", name, "--log-every-n-steps", "1", *extra]


def rendered_lines(raw: str):
    """The lines as a terminal shows them: a carriage return moves back to the line's start and what follows
    overwrites (cursor-movement escapes dropped)."""
    for physical in CSI.sub("", raw).split("\n"):
        line = ""
        for i, part in enumerate(physical.split("\r")):
            line = part + line[len(part):] if i else part
        yield line


def run_on_a_terminal(args, timeout=240.0) -> str:
    """``python -m naflex_accum.train ARGS`` with stdout and stderr on a pseudo-terminal 100 columns wide."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 100, 0, 0))
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="100")
    proc = subprocess.Popen([sys.executable, "-m", "naflex_accum.train", *args], stdin=subprocess.DEVNULL,
                            stdout=slave, stderr=slave, env=env, cwd=ROOT)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                data = os.read(master, 65536)
            except OSError as exc:  # EIO: the child closed its side
                if exc.errno == errno.EIO:
                    break
                raise
            if not data:
                break
            chunks.append(data)
        assert proc.wait(timeout=max(1.0, deadline - time.monotonic())) == 0, b"".join(chunks).decode()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    return b"".join(chunks).decode("utf-8", "replace")


def test_log_lines_and_the_progress_bar_never_share_a_line(shards, tmp_path):
    raw = run_on_a_terminal(argv(shards, tmp_path, "tty"))
    lines = list(rendered_lines(raw))
    assert any("epoch 0" in line and "|" in line for line in raw.split("\r")), "no progress bar was drawn"
    records = [line for line in lines if RECORD.search(line)]
    assert sum("Train Epoch:" in line for line in records) >= 4
    mid_bar = [line for line in records if not RECORD.match(line)]
    assert mid_bar == [], "log lines drawn after the progress bar on its line"


def test_a_finished_run_ends_with_a_summary(shards, tmp_path, capsys):
    extra = ("--val-data", shards.val, "--val-seq-len", "16", "--naflex-seq-lens", "36", "16")
    assert cli_main(["train", *argv(shards, tmp_path, "run", *extra)]) == 0
    out = capsys.readouterr().out
    log = (tmp_path / "run" / "out.log").read_text()
    for text in (out, log):
        finished = [line for line in text.splitlines() if "Finished: epoch 1/1" in line]
        assert len(finished) == 1, text[-2000:]
        assert "optimizer steps" in finished[0] and "last epoch's average loss" in finished[0]
        assert f"last checkpoint: {tmp_path / 'run' / 'checkpoints' / 'epoch_1.pt'}" in finished[0]
        final_eval = [line for line in text.splitlines() if "Final eval (epoch 1):" in line]
        assert len(final_eval) == 1 and "image_to_text_R@1" in final_eval[0]
        assert "num_samples" not in final_eval[0] and "epoch 1.0000" not in final_eval[0]  # counters, not metrics
        # the summary comes last, after the epoch's own lines
        assert text.rindex("Finished: epoch") > text.rindex("Eval Epoch: 1")
        sorted_note = [line for line in text.splitlines() if "--naflex-seq-lens 36 16 taken in ascending" in line]
        assert len(sorted_note) == 1 and sorted_note[0].rstrip().endswith("16 36")


def test_resuming_a_finished_run_says_nothing_to_do(shards, tmp_path, capsys):
    assert cli_main(["train", *argv(shards, tmp_path, "done")]) == 0
    root = tmp_path / "done"
    before = {p: p.stat().st_mtime_ns for p in root.rglob("*")}
    capsys.readouterr()
    assert cli_main(["train", *argv(shards, tmp_path, "done", "--resume", "latest")]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "Nothing to do" in line]
    assert len(lines) == 1, out
    assert str(root / "checkpoints" / "epoch_1.pt") in lines[0]
    assert "holds 1 finished epoch " in lines[0] and "--epochs is 1" in lines[0] and "larger --epochs" in lines[0]
    assert "Train Epoch" not in out and "Finished" not in out
    after = {p: p.stat().st_mtime_ns for p in root.rglob("*") if p.name != ".lock"}
    assert after == {p: t for p, t in before.items() if p.name != ".lock"}, "the run folder changed"
