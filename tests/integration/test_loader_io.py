"""Transient I/O ends a run with exit 74 (a cluster script requeues it), in one line, leaving no process behind.

The real thing in subprocesses of the trainer: the data folder removed mid-run, a
``pipe:`` source that hangs (a FIFO nobody writes) with and without loader workers
(``--data-timeout`` holds in-process too), ``pipe:`` commands checked in ``/proc`` for
their signal dispositions and for survivors after the run is killed, and the run
folder's storage failing mid-run (``loader_jobs/lost_storage_trainer.py``: ESTALE and
EIO are 74, a full or read-only disk stays 2). Every process of a run carries a marker
in its environment, so ``/proc`` tells its leftovers from anything else.
"""
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from longrun_common import SUBPROCESS_ENV, make_shards, run_argv, trainer_cmd

EXIT_LOADER = 74
PROMPT = 20.0  # seconds from the fault to the exit, at most
JOBS = Path(__file__).resolve().parents[1] / "loader_jobs"


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return make_shards(tmp_path_factory.mktemp("loader-io"))


def _marked(tmp_path) -> dict:
    return {**SUBPROCESS_ENV, "NAFLEX_TEST_RUN": str(tmp_path)}


def _processes_of(tmp_path) -> list:
    """Pids of live processes whose environment carries ``tmp_path``'s marker (a run's, and its children's)."""
    mark, found = f"NAFLEX_TEST_RUN={tmp_path}".encode(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if mark in f.read().split(b"\0"):
                    with open(f"/proc/{entry}/stat") as stat:
                        if stat.read().rsplit(")", 1)[1].split()[0] != "Z":
                            found.append(int(entry))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def _kill_leftovers(tmp_path) -> None:
    for pid in _processes_of(tmp_path):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _start(tmp_path, argv, job=None):
    log = open(tmp_path / "out.txt", "w")
    command = [sys.executable, str(job[0]), *job[1:], "--", *argv] if job else trainer_cmd(*argv)
    return subprocess.Popen(command, env=_marked(tmp_path), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _wait_for(tmp_path, proc, done, timeout=90.0):
    deadline = time.time() + timeout
    while not done():
        assert proc.poll() is None and time.time() < deadline, (tmp_path / "out.txt").read_text()[-3000:]
        time.sleep(0.05)


def _first_step(tmp_path, proc):
    _wait_for(tmp_path, proc, lambda: list((tmp_path / "run" / "checkpoints").glob("step_*.pt")))


def _ended(tmp_path, proc, timeout=120.0):
    """(exit status, seconds it took, the output, its ERROR lines); the run killed if it outlives ``timeout``."""
    since = time.time()
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        code = f"still running {timeout:g} s after the fault"
    out = (tmp_path / "out.txt").read_text()
    return code, time.time() - since, out, [line for line in out.splitlines() if "| ERROR |" in line]


def _no_leftovers(tmp_path, within=15.0) -> list:
    """The run's processes still alive ``within`` seconds from now (none, unless something leaked)."""
    deadline = time.time() + within
    while _processes_of(tmp_path) and time.time() < deadline:
        time.sleep(0.1)
    left = [(pid, Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
            for pid in _processes_of(tmp_path)]
    _kill_leftovers(tmp_path)
    return left


@pytest.mark.parametrize("workers", [0, 2])
def test_storage_vanishing_mid_run_exits_74_naming_the_shard(shards, tmp_path, workers):
    """Red before: every sample of the vanished shard counted unusable, then exit 2 (a bad setting)."""
    data = tmp_path / "data"
    shutil.copytree(Path(shards.train).parent, data)
    shard = data / Path(shards.train.replace("{000000..000000}", "000000")).name
    argv = run_argv(SimpleNamespace(train=str(shard)), "naflex-tiny", tmp_path, "run", "--save-every-n-steps", "1",
                    epochs=30, workers=workers)
    proc = _start(tmp_path, argv)
    try:
        _first_step(tmp_path, proc)
        shutil.rmtree(data)  # the mount went away: the next read of the shard finds nothing
        code, took, out, errors = _ended(tmp_path, proc)
    finally:
        _kill_leftovers(tmp_path)
    assert code == EXIT_LOADER and took < PROMPT, (code, took, out[-3000:])
    assert len(errors) == 1 and "Traceback" not in out, out[-3000:]
    assert f"shard {shard} cannot be read: [Errno 2] No such file or directory (ENOENT)" in errors[0], errors[0]
    assert errors[0].endswith(f"run again with --resume latest --name run (exit {EXIT_LOADER})")


def _hanging_source(tmp_path, shards) -> str:
    """A ``pipe:`` source that reads the shard until ``tmp_path/hang`` exists, then a FIFO nobody writes."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    shard = shards.train.replace("{000000..000000}", "000000")
    return f"pipe:if [ -e {tmp_path}/hang ]; then cat {fifo}; else cat {shard}; fi"


@pytest.mark.parametrize("workers", [0, 2])
def test_a_hung_pipe_source_ends_the_run_after_the_data_timeout(shards, tmp_path, workers):
    """Red before: with --workers 0 the run hung until killed; with workers, its blocked `cat`s outlived it."""
    argv = run_argv(SimpleNamespace(train=_hanging_source(tmp_path, shards)), "naflex-tiny", tmp_path, "run",
                    "--save-every-n-steps", "1", "--data-timeout", "3", epochs=30, workers=workers)
    proc = _start(tmp_path, argv)
    try:
        _first_step(tmp_path, proc)
        (tmp_path / "hang").touch()  # from the next shard read on, the source hangs
        code, took, out, errors = _ended(tmp_path, proc, timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    left = _no_leftovers(tmp_path)
    # at most a step in progress, an epoch's end (a checkpoint), the timeout, and the way out
    assert code == EXIT_LOADER and took < 3 + PROMPT, (code, took, out[-3000:])
    assert len(errors) == 1 and "Traceback" not in out, out[-3000:]
    expected = "no batch came from the loader (reading in this process) for 3 s (--data-timeout): killed its " \
               "pipe: command(s)" if workers == 0 else "the loader workers sent no batch for 3 s (--data-timeout)"
    assert expected in errors[0], errors[0]
    assert not left, left


def test_a_pipe_source_that_hangs_at_the_start_is_bounded_too(shards, tmp_path):
    """Red before: counting the shards' samples waited for ever on the FIFO."""
    (tmp_path / "hang").touch()
    argv = run_argv(SimpleNamespace(train=_hanging_source(tmp_path, shards)), "naflex-tiny", tmp_path, "run",
                    "--data-timeout", "2", workers=0)
    proc = _start(tmp_path, argv)
    code, took, out, _ = _ended(tmp_path, proc, timeout=60)
    left = _no_leftovers(tmp_path)
    assert code == EXIT_LOADER and "Traceback" not in out, (code, out[-3000:])
    lines = out.strip().splitlines()
    assert lines[-1].startswith("naflex-accum train: error: counting the shards' samples had not ended after 2 s "
                                "(--data-timeout): killed its pipe: command(s)"), lines[-1]
    assert not left, left


def _python_children(pid: int) -> set:
    """The loader workers of the trainer ``pid`` (its children running Python, not a ``pipe:`` command's shell)."""
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return {int(c) for c in children if os.path.realpath(f"/proc/{c}/exe") == os.path.realpath(sys.executable)}


def _ignored(pid: int) -> set:
    """Which of SIGTERM, SIGUSR1 and SIGINT the process ``pid`` ignores (none if it is gone meanwhile)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = int(next(line.split()[1] for line in f if line.startswith("SigIgn:")), 16)
    except OSError:
        return set()
    return {sig for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT) if mask >> (sig - 1) & 1}


@pytest.mark.parametrize("kill,workers", [("trainer", 0), ("trainer", 2), ("worker", 2)])
def test_pipe_commands_never_outlive_a_killed_run(shards, tmp_path, kill, workers):
    """Red before: the commands ignored SIGTERM and SIGUSR1 (as the workers do) and outlived the run as orphans."""
    shard = shards.train.replace("{000000..000000}", "000000")
    source = f"pipe:cat {shard} && exec sleep 1000 >&-"  # its output read, it lingers: commands are always there
    argv = run_argv(SimpleNamespace(train=source), "naflex-tiny", tmp_path, "run", "--save-every-n-steps", "1",
                    epochs=30, workers=workers)
    proc = _start(tmp_path, argv)
    try:
        _first_step(tmp_path, proc)
        trainer_and_workers = {proc.pid, *_python_children(proc.pid)}
        assert len(trainer_and_workers) == 1 + workers
        _wait_for(tmp_path, proc, lambda: set(_processes_of(tmp_path)) - trainer_and_workers)
        commands = set(_processes_of(tmp_path)) - trainer_and_workers
        ignoring = {pid: ignored for pid in commands if (ignored := _ignored(pid))}
        victim = proc.pid if kill == "trainer" else max(trainer_and_workers - {proc.pid})
        os.kill(victim, signal.SIGKILL)  # as the OOM killer kills: no handler runs
        code, _, out, errors = _ended(tmp_path, proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    left = _no_leftovers(tmp_path)
    assert not ignoring, f"pipe: commands ignore {ignoring}"
    assert not left, left
    if kill == "worker":
        assert code == EXIT_LOADER and len(errors) == 1 and "was killed by SIGKILL" in errors[0], out[-3000:]


@pytest.mark.parametrize("name,code", [("ESTALE", EXIT_LOADER), ("EIO", EXIT_LOADER), ("EROFS", 2)])
def test_the_run_folder_s_storage_failing_mid_run(shards, tmp_path, name, code):
    """Red before: a stale handle or an I/O error writing a checkpoint was a bad setting (exit 2), not requeued."""
    argv = run_argv(shards, "naflex-tiny", tmp_path, "run", "--save-every-n-steps", "1", epochs=30, workers=0)
    proc = _start(tmp_path, argv, job=(JOBS / "lost_storage_trainer.py", str(tmp_path / "gone"), name))
    try:
        _first_step(tmp_path, proc)
        (tmp_path / "gone").touch()
        status, took, out, errors = _ended(tmp_path, proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert status == code and took < PROMPT and "Traceback" not in out, (status, out[-3000:])
    if code == EXIT_LOADER:
        assert len(errors) == 1 and errors[0].split(" | ERROR | ")[1].startswith(
            "Writing the run folder failed on rank 0: cannot write "), errors
        assert f"[Errno {getattr(__import__('errno'), name)}]" in errors[0] and "went away" in errors[0]
        assert errors[0].endswith(f"(exit {EXIT_LOADER})")
    else:
        err = out.strip().splitlines()[-1]
        assert err.startswith("naflex-accum train: error: cannot write ") and "Read-only file system" in err, err


def test_a_failed_pipe_command_is_bad_data_named_by_its_status(shards):
    """Red before: webdataset's gopen said "ReadError: empty file", or its own repr of the Popen arguments."""
    from naflex_accum.data.samples import count_samples

    shard = shards.train.replace("{000000..000000}", "000000")
    assert count_samples("pipe:false") == (0, "PipeFailed: pipe: command 'false' exited with status 1 "
                                              "(ReadError: empty file)")
    assert count_samples(f"pipe:cat {shard}; exit 3") == (160, f"PipeFailed: pipe: command 'cat {shard}; exit 3' "
                                                               f"exited with status 3")
    assert count_samples(f"pipe:cat {shard} | cat") == (160, None)  # a pipeline; SIGPIPE after the end is no error


BOUNDED = r"""
import signal, sys, time
from naflex_accum.data import pipes
from naflex_accum.data.alarm import LoaderTimeout, bounded

def mine(signum, frame):
    print("the previous handler ran")
signal.signal(signal.SIGALRM, mine)
with bounded(5):
    time.sleep(0.01)  # done in time: nothing raised
assert signal.getsignal(signal.SIGALRM) is mine and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
for timeout in (1e-6, 0.5):  # one that expires before the block has begun, and one inside a blocked read
    stream = pipes.PipeStream("pipe:sleep 1000")
    started = time.monotonic()
    try:
        with bounded(timeout):
            stream.read(1)
        print("nothing raised")
    except LoaderTimeout as exc:
        print(f"{time.monotonic() - started:.1f} s: {exc}")
    finally:
        status = stream._exited(5.0)
        stream.close()
    print("command status", status)
assert signal.getsignal(signal.SIGALRM) is mine
"""


def test_the_in_process_timeout_interrupts_a_blocked_read_and_kills_its_command():
    """Red before: no in-process bound (``naflex_accum.data.alarm`` did not exist)."""
    done = subprocess.run([sys.executable, "-c", BOUNDED], env=SUBPROCESS_ENV, capture_output=True, text=True,
                          timeout=60)
    out = done.stdout.splitlines()
    assert done.returncode == 0 and len(out) == 4, done.stdout + done.stderr[-3000:]
    for took, line in zip((0.0, 0.5), (out[0], out[2])):
        assert line.startswith(f"{took:.1f} s: no batch came from the loader (reading in this process) for ") and \
            "(--data-timeout): killed its pipe: command(s) (process groups " in line, out
    assert out[1] == out[3] == "command status -9", out  # killed by the timeout's SIGKILL
