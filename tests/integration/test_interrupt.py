"""Ctrl-C as a terminal sends it (SIGINT to the whole foreground process group: the command and its loader
workers), at chosen moments of real processes: one line ``PROG: interrupted``, exit 130, no traceback, no
process of the group left, and what was saved intact (the run resumes exactly). The moments that need to be
exact come from ``tests/interrupt_driver.py``. Every subprocess has a timeout."""
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from longrun_common import SUBPROCESS_ENV, assert_identical, reference, run_argv, train_in_process, trainer_cmd, weights
from upstream_real import upstream_env

from naflex_accum.upstream.tiny_tasks import write_model_dir

TESTS = Path(__file__).resolve().parent.parent
DRIVER_ENV = {**SUBPROCESS_ENV, "PYTHONPATH": str(TESTS) + os.pathsep + SUBPROCESS_ENV["PYTHONPATH"]}
CONSOLE_SCRIPT = Path(sys.executable).with_name("naflex-accum")


@pytest.fixture(scope="module", autouse=True)
def ctrl_c_as_in_a_terminal():
    """A terminal's command starts with SIGINT at its default. Started in the background (``make test &``) or
    under nohup, this process has it ignored, and its commands would inherit that (the trainer keeps an ignored
    SIGINT ignored, as nohup asks): a handler here is not inherited, so they start as in a terminal."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return reference(tmp_path_factory)


def train_started(proc, log: Path, timeout: float = 180) -> bool:
    deadline = time.time() + timeout
    while "Train Epoch" not in log.read_text():
        if proc.poll() is not None or time.time() > deadline:
            return False
        time.sleep(0.02)
    return True


def start(cmd, log: Path, env=None):
    """``cmd`` in a session of its own: its process group is what a terminal's Ctrl-C reaches."""
    return subprocess.Popen(cmd, env=env or SUBPROCESS_ENV, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def driven(moment: str, argv, log: Path):
    """The console command ``argv`` with a Ctrl-C at ``moment`` (``tests/interrupt_driver.py``), under python -m."""
    return start([sys.executable, "-m", "interrupt_driver", moment, *argv], log, DRIVER_ENV)


def group(pgid: int) -> list:
    """The live processes of process group ``pgid``."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue
        if int(pgrp) == pgid and state != "Z":
            pids.append(int(stat.parent.name))
    return pids


def interrupted(proc, log: Path, prog: str, timeout: float = 180) -> str:
    """Wait for ``proc``; assert the one line, exit 130, no traceback, and that no process of its group is left."""
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    deadline = time.time() + 10
    while group(proc.pid) and time.time() < deadline:
        time.sleep(0.1)
    left = group(proc.pid)
    if left:
        os.killpg(proc.pid, signal.SIGKILL)
    out = log.read_text()
    assert proc.returncode == 130, out[-3000:]
    for word in ("Traceback", "KeyboardInterrupt", "Exception ignored"):
        assert word not in out, out[-3000:]
    assert not re.search(r"^Process [\w-]+:$", out, re.M), out[-3000:]  # multiprocessing's word for a child's
    assert out.count("interrupted") == 1 and out.rstrip().splitlines()[-1] == f"{prog}: interrupted", out[-3000:]
    assert not left, f"left running: {left}"
    return out


def importing_torch(proc, timeout: float = 120, library: str = "libtorch") -> bool:
    """Wait until ``proc`` has mapped ``library`` (torch's, or numpy's which torch loads first): its imports are under
    way (they run for seconds more)."""
    maps, deadline = Path(f"/proc/{proc.pid}/maps"), time.time() + timeout
    while proc.poll() is None and time.time() < deadline:
        try:
            if library in maps.read_text():
                return True
        except OSError:
            pass
        time.sleep(0.005)
    return False


COMMANDS = {
    "train": ([str(CONSOLE_SCRIPT), "train", "--train-data", "/nonexistent/{0..1}.tar", "--model", "naflex-tiny"],
              "naflex-accum train"),
    "openclip": ([sys.executable, "-m", "naflex_accum.openclip", "--use-naflex", "--model", "naflex-tiny"],
                 "naflex_accum.openclip"),
    "export": ([str(CONSOLE_SCRIPT), "export", "/nonexistent/epoch_1.pt", "/nonexistent/out"], "naflex-accum export"),
    "verify": ([str(CONSOLE_SCRIPT), "verify"], "naflex-accum verify"),
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_ctrl_c_while_the_command_imports_torch(tmp_path, command):
    cmd, prog = COMMANDS[command]
    proc = start(cmd, tmp_path / "log")
    importing = importing_torch(proc)
    os.killpg(proc.pid, signal.SIGINT)
    out = interrupted(proc, tmp_path / "log", prog)
    assert importing and out.strip() == f"{prog}: interrupted"


@pytest.mark.parametrize("after", [0.0, 0.02, 0.05, 0.1, 0.2])
def test_ctrl_c_while_numpy_and_torch_initialise(tmp_path, after):
    """Raised inside numpy's or torch's initialisation, a KeyboardInterrupt left numpy half loaded (a later
    import failed), was swallowed (the command ran on) or aborted the process from a C++ callback: a Ctrl-C
    while the command's modules load ends it at once, with its line."""
    cmd, prog = COMMANDS["train"]
    proc = start([sys.executable, "-m", "naflex_accum.train", *cmd[2:]], tmp_path / "log")
    assert importing_torch(proc, library="_multiarray_umath")  # numpy's C extension: torch loads it first
    time.sleep(after)
    os.killpg(proc.pid, signal.SIGINT)
    interrupted(proc, tmp_path / "log", prog)


PACKAGE = Path(__file__).resolve().parents[2] / "naflex_accum"
EARLY = {"verify": COMMANDS["verify"], "openclip": COMMANDS["openclip"],
         "python -m train": ([sys.executable, "-m", "naflex_accum.train", *COMMANDS["train"][0][2:]],
                             "naflex-accum train")}


# runs a ``python -m`` module with a SIGINT raised as its ``entry()`` starts, before entry's own try: the moment
# a Ctrl-C landed on by chance in test_ctrl_c_as_early_as_possible below, made certain
AT_ENTRY = """import os, runpy, signal, sys
def hook(frame, event, arg):
    if event == "call" and frame.f_code.co_name == "entry":
        sys.setprofile(None)
        os.kill(os.getpid(), signal.SIGINT)
sys.argv[0] = sys.argv[1]
sys.setprofile(hook)
runpy.run_module(sys.argv.pop(1), run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("module,prog", [("naflex_accum.openclip", "naflex_accum.openclip"),
                                         ("naflex_accum.train", "naflex-accum train"), ("naflex_accum.cli", "naflex-accum")])
def test_ctrl_c_as_the_entry_point_starts_is_the_one_line(module, prog):
    proc = subprocess.run([sys.executable, "-c", AT_ENTRY, module], capture_output=True, text=True, timeout=120,
                          env=SUBPROCESS_ENV)
    assert (proc.returncode, proc.stderr.strip(), proc.stdout) == (130, f"{prog}: interrupted", ""), proc.stderr


def early_ctrl_c(cmd, log: Path, delay: float):
    """``cmd`` with a Ctrl-C ``delay`` seconds after its start: ``(exit status, output)``."""
    proc = start(cmd, log)
    time.sleep(delay)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, log.read_text()


@pytest.mark.parametrize("command", sorted(EARLY))
def test_ctrl_c_as_early_as_possible(tmp_path, command):
    """From the first of the command's own lines on, a Ctrl-C is the one line: pressed at once, then a little
    later each time (bounded) until three in a row found the command running. Before that only Python's own
    start-up can be under way (docs/long-runs.md): a traceback, if any, passes through none of our modules."""
    cmd, prog = EARLY[command]
    handled, tries = 0, 0
    while handled < 3 and tries < 60:
        code, out = early_ctrl_c(cmd, tmp_path / f"log{tries}", delay=0.003 * tries)
        ours = [line for line in out.splitlines() if line.strip().startswith("File ") and str(PACKAGE) in line]
        assert not ours, out[-3000:]
        if code == 130:
            assert out.strip() == f"{prog}: interrupted", out[-3000:]
        handled = handled + 1 if code == 130 else 0
        tries += 1
    assert handled == 3, f"no Ctrl-C in {tries} tries found {command} running"


def test_ctrl_c_inside_an_exec_while_importing(tmp_path):
    """A KeyboardInterrupt out of an exec() of a string marks CPython to end a python -m process by SIGINT."""
    proc = driven("dataclass-import", ["verify"], tmp_path / "log")
    assert interrupted(proc, tmp_path / "log", "naflex-accum verify").strip() == "naflex-accum verify: interrupted"


def test_ctrl_c_as_a_loader_worker_starts(setup, tmp_path):
    """Sent by the second of 2 workers right after its fork: the first worker runs, the loader is half started."""
    shards, model, _ = setup
    argv = run_argv(shards, model, tmp_path, "w", epochs=1, samples=64, workers=2)
    proc = driven("worker-start", ["train", *argv], tmp_path / "log")
    interrupted(proc, tmp_path / "log", "naflex-accum train")
    assert not list((tmp_path / "w/checkpoints").iterdir())


def test_ctrl_c_mid_training_with_2_workers_then_resume_is_exact(setup, tmp_path):
    """Pressed twice, as people do: the second, while the trainer stops, changes nothing."""
    shards, model, whole = setup
    # --data-slots 1: the batches of the reference run's 1 worker, whatever the number of workers
    argv = run_argv(shards, model, tmp_path, "m", "--save-every-n-steps", "1", "--data-slots", "1", workers=2)
    ckpts = tmp_path / "m/checkpoints"
    proc = start(trainer_cmd(*argv), tmp_path / "log")
    deadline = time.time() + 180
    while not (ckpts / "step_2.pt").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGINT)
    interrupted(proc, tmp_path / "log", "naflex-accum train")
    assert not [p for p in ckpts.iterdir() if ".tmp-" in p.name]
    result = train_in_process([*argv, "--resume", "latest"])
    assert result["exit_code"] == 0 and result["epoch"] == 2
    assert_identical(weights(ckpts / "epoch_2.pt"), whole)


def test_ctrl_c_during_evaluation(setup, tmp_path):
    shards, model, _ = setup
    argv = run_argv(shards, model, tmp_path, "e", "--val-data", shards.val, epochs=1, samples=64, workers=2)
    proc = driven("evaluation", ["train", *argv], tmp_path / "log")
    out = interrupted(proc, tmp_path / "log", "naflex-accum train")
    assert "Train Epoch: 0" in out


def test_ctrl_c_during_a_checkpoint_write_keeps_the_one_before(setup, tmp_path):
    """Inside step_2.pt's bytes: it is not there, step_1.pt is whole, and the resume from it is exact."""
    shards, model, whole = setup
    argv = run_argv(shards, model, tmp_path, "c", "--save-every-n-steps", "1")
    proc = driven("checkpoint-write", ["train", *argv], tmp_path / "log")
    interrupted(proc, tmp_path / "log", "naflex-accum train")
    ckpts = tmp_path / "c/checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_1.pt"]  # no step_2.pt, no temporary file
    result = train_in_process([*argv, "--resume", "latest"])
    assert result["exit_code"] == 0 and result["epoch"] == 2
    assert_identical(weights(ckpts / "epoch_2.pt"), whole)


def test_ctrl_c_during_an_export_leaves_nothing(setup, tmp_path, tmp_path_factory):
    checkpoint = tmp_path_factory.getbasetemp() / "longrun-reference/logs/whole/checkpoints/epoch_2.pt"  # setup's
    proc = driven("export-write", ["export", str(checkpoint), str(tmp_path / "out")], tmp_path / "log")
    interrupted(proc, tmp_path / "log", "naflex-accum export")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log"]  # no out, no hidden folder it was made in


def test_ctrl_c_while_upstream_trains_through_the_runner(upstream_src, demo_shards, tmp_path):
    """Upstream open_clip main's own loop and webdataset loader worker, under python -m naflex_accum.openclip."""
    model = write_model_dir(str(tmp_path / "tiny-clip"), "clip")
    cmd = [sys.executable, "-m", "naflex_accum.openclip", "--use-naflex", "--model", model, "--train-data",
           demo_shards, "--dataset-type", "webdataset", "--train-num-samples", "40", "--batch-size", "16",
           "--naflex-seq-lens", "16", "--naflex-max-tokens-per-batch", "256", "--accum-freq", "2", "--epochs", "50",
           "--workers", "1", "--lr", "1e-3", "--warmup", "0", "--device", "cpu", "--logs", str(tmp_path / "logs"),
           "--name", "clip", "--log-every-n-steps", "1"]
    proc = start(cmd, tmp_path / "log", upstream_env(upstream_src, NAFLEX_ACCUM_VERIFY="0", NAFLEX_ACCUM_MODE=None))
    started = train_started(proc, tmp_path / "log")
    os.killpg(proc.pid, signal.SIGINT)
    out = interrupted(proc, tmp_path / "log", "naflex_accum.openclip")
    assert started and "Train Epoch" in out
