"""Faults with the real thing, in subprocesses: kill -9 at a random moment, SIGTERM to the whole process
group, a second run on a locked folder, a full disk, an undeletable step checkpoint, a STOP file written while
the trainer starts. Every subprocess has a timeout."""
import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from longrun_common import SUBPROCESS_ENV, assert_identical, reference, run_argv, train_in_process, trainer_cmd, weights

from naflex_accum.train.ending.preempt import EXIT_STOPPED

SEED = int(os.environ.get("NAFLEX_FAULT_SEED", time.time_ns() % 10_000))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return reference(tmp_path_factory)


def start(argv, log_path: Path, env=None, **kw):
    """The trainer in its own session (so a group signal reaches it and its data-loader worker, as SLURM's does)."""
    return subprocess.Popen(trainer_cmd(*argv), env=env or SUBPROCESS_ENV, stdout=open(log_path, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True, **kw)


def wait_for(predicate, proc, timeout=90.0):
    deadline = time.time() + timeout
    while not predicate():
        if proc.poll() is not None or time.time() > deadline:
            return False
        time.sleep(0.05)
    return True


def folder_locked(lock: Path) -> bool:
    """Whether another process holds the run folder's lock (``RunLock``'s POSIX lock)."""
    import fcntl

    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.lockf(fd, fcntl.LOCK_UN)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def test_kill_9_at_a_random_moment_then_resume_is_exact(setup, tmp_path):
    """Random moment: after a random step checkpoint plus a random delay (a save may be under way)."""
    shards, model, whole = setup
    rng = random.Random(SEED)
    after_step, delay = rng.randint(0, 6), rng.uniform(0.0, 0.4)
    argv = run_argv(shards, model, tmp_path, "k", "--save-every-n-steps", "1", "--keep-last", "2")
    ckpts = tmp_path / "k/checkpoints"
    proc = start(argv, tmp_path / "a.log")
    try:
        target = (lambda: (ckpts / f"step_{after_step}.pt").exists()) if after_step else \
            (lambda: "Train Epoch" in (tmp_path / "a.log").read_text())
        assert wait_for(target, proc), (tmp_path / "a.log").read_text()[-3000:]
        time.sleep(delay)
        os.kill(proc.pid, signal.SIGSTOP)  # frozen where it is, still holding the run folder
        # A run that finished within the delay has let its folder go while still exiting.
        alive = proc.poll() is None and folder_locked(tmp_path / "k" / ".lock")
        if alive:  # a second run on the same folder is refused while the first lives
            second = subprocess.run(trainer_cmd(*argv, "--resume", "latest"), env=SUBPROCESS_ENV,
                                    capture_output=True, text=True, timeout=120)
            assert second.returncode == 2, second.stdout[-2000:] + second.stderr[-2000:]
            assert "in use by another live process" in second.stderr and f"pid {proc.pid}" in second.stderr
            assert second.stderr.strip().count("\n") == 0
        os.killpg(proc.pid, signal.SIGKILL)  # kill -9 the trainer and its worker
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    left = sorted(p.name for p in ckpts.iterdir()) if ckpts.exists() else []
    print(f"seed {SEED}: SIGKILL after step {after_step} + {delay:.2f}s (alive: {alive}); left {left}")
    result = train_in_process([*argv, "--resume", "latest"])  # takes the dead process's lock over
    assert result["exit_code"] == 0 and result["epoch"] == 2
    assert not [p for p in ckpts.iterdir() if ".tmp-" in p.name]
    assert_identical(weights(ckpts / "epoch_2.pt"), whole)


def test_sigterm_to_the_process_group_saves_and_exits_75(setup, tmp_path):
    shards, model, whole = setup
    delay = random.Random(SEED + 1).uniform(0.0, 1.0)
    argv = run_argv(shards, model, tmp_path, "t")
    proc = start(argv, tmp_path / "t.log")
    try:
        assert wait_for(lambda: "Train Epoch" in (tmp_path / "t.log").read_text(), proc)
        time.sleep(delay)
        os.killpg(proc.pid, signal.SIGTERM)  # the trainer and its data-loader worker, as SLURM signals a step
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = (tmp_path / "t.log").read_text()
    print(f"seed {SEED}: SIGTERM {delay:.2f}s after the first step: exit {proc.returncode}")
    assert "Traceback" not in out, out[-3000:]
    if proc.returncode == 0:  # the signal came after the last step: nothing left to stop
        assert "Stopped on request" not in out
    else:
        assert proc.returncode == EXIT_STOPPED, out[-3000:]
        assert out.count("Stopped on request (SIGTERM)") == 1 and "epoch_latest.pt" in out
        result = train_in_process([*argv, "--resume", "latest"])
        assert result["exit_code"] == 0
    assert_identical(weights(tmp_path / "t/checkpoints/epoch_2.pt"), whole)


def _small_disk(folder: Path, size: str):
    """A real full disk: a small tmpfs (root), else ``None`` (the caller uses RLIMIT_FSIZE)."""
    folder.mkdir()
    if os.geteuid() != 0:
        return None
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True)
    return folder if done.returncode == 0 else None


@pytest.mark.parametrize("fill", ["checkpoint", "log"])
def test_full_disk_is_one_line_and_leaves_no_partial_checkpoint(setup, tmp_path, fill):
    import resource

    shards, model, _ = setup
    small = tmp_path / "small"
    mounted = _small_disk(small, "4m")
    limit = None
    try:
        if mounted is None:  # unprivileged: the kernel's per-process file-size limit gives EFBIG instead
            if fill == "log":
                pytest.skip("needs a small tmpfs (root) to fill the disk under out.log")
            limit = 4 << 20
        elif fill == "log":  # leave two pages: .lock and params.txt fit, the log lines do not
            filler = small / "filler"
            with open(filler, "wb") as f:
                f.write(b"\0" * ((4 << 20) - (8 << 10)))
        extra = ("--save-every-n-steps", "1") if fill == "checkpoint" else ()
        argv = run_argv(shards, model, small, "full", *extra, epochs=1, workers=0)

        def set_limit():
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        proc = subprocess.run(trainer_cmd(*argv), env=SUBPROCESS_ENV, capture_output=True, text=True, timeout=120,
                              preexec_fn=set_limit if limit else None)
        err = proc.stderr.strip()
        print(f"{'tmpfs 4m' if mounted else 'RLIMIT_FSIZE 4 MiB'}: exit {proc.returncode}: {err}")
        assert proc.returncode == 2 and err.count("\n") == 0 and "Traceback" not in err, proc.stdout[-2000:] + err
        reason = "No space left on device" if mounted else "File too large"
        assert f"cannot write {small / 'full'}" in err and reason in err
        assert ("step_1.pt" if fill == "checkpoint" else "out.log") in err
        if fill == "checkpoint":  # a step trained: the folder stays, with its log
            leftovers = [p.name for p in (small / "full/checkpoints").iterdir()]
            assert leftovers == [], leftovers  # no partial file under a checkpoint name, no temporary file
            assert err.split(": error: ", 1)[1] in (small / "full/out.log").read_text()  # the run's log has it too
        else:  # refused before training: the folder this start made is gone
            assert not (small / "full").exists(), sorted(str(p) for p in (small / "full").rglob("*"))
    finally:
        if mounted is not None:
            subprocess.run(["umount", str(small)])


def test_a_tensorboard_folder_that_cannot_be_written_is_one_line_without_its_threads_traceback(tmp_path, monkeypatch):
    """Red before: tensorboard's writer thread printed its OSError's traceback (``threading.excepthook``), then the
    run its one line."""
    import logging

    from naflex_accum.errors import WriteError
    from naflex_accum.train.output.logs import RunLogger

    folder = _small_disk(tmp_path / "read-only", "1m,ro")
    if folder is None:
        pytest.skip("needs a read-only tmpfs (root)")
    printed = []

    def hook(args):  # the default hook prints the traceback
        printed.append(args.exc_value)
    monkeypatch.setattr(threading, "excepthook", hook)
    try:
        with pytest.raises(WriteError, match=f"cannot write {folder}: .*Read-only file system"):
            run_logger = RunLogger(logging.getLogger("test"), True, folder)  # its thread may fail first
            thread = next(t for t in threading.enumerate() if type(t).__name__ == "_AsyncWriterThread")
            thread.join(timeout=10)  # it met the read-only folder and ended
            run_logger.close()
    finally:
        subprocess.run(["umount", str(folder)])
    assert printed == [] and threading.excepthook is hook  # and the hook is back


def test_a_signal_after_the_run_has_saved_does_not_kill_the_process():
    """SIGTERM between the end of a run and the process exit (a time limit landing during teardown): the
    entry point's process exits with the run's status, not -15; in-process callers get their handlers back."""
    code = ("import os, signal, sys\n"
            "from pathlib import Path\n"
            "from types import SimpleNamespace\n"
            "from naflex_accum.train.ending import preempt\n"
            "world = SimpleNamespace(is_master=True)\n"
            "stop = preempt.StopRequest(Path('STOP'), world, ends_process=sys.argv[1] == 'entry')\n"
            "stop.close()\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "sys.exit(0)\n")
    entry = subprocess.run([sys.executable, "-c", code, "entry"], env=SUBPROCESS_ENV, timeout=60)
    in_process = subprocess.run([sys.executable, "-c", code, "library"], env=SUBPROCESS_ENV, timeout=60)
    assert entry.returncode == 0
    assert in_process.returncode == -signal.SIGTERM  # the default handler is back


@contextlib.contextmanager
def undeletable(path: Path):
    """``path`` cannot be unlinked: the immutable attribute (``chattr +i``, ext4/xfs/btrfs as root), else the file
    bind-mounted onto itself (unlinking a mount point fails with EBUSY); undone on leaving, whatever happens."""
    if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0:
        undo = ["chattr", "-i", str(path)]
    elif subprocess.run(["mount", "--bind", str(path), str(path)], capture_output=True).returncode == 0:
        undo = ["umount", str(path)]
    else:
        pytest.skip(f"cannot make {path} undeletable here (chattr +i and mount --bind both refused)")
    try:
        yield
    finally:
        subprocess.run(undo, capture_output=True)


def test_a_step_checkpoint_that_cannot_be_deleted_is_a_warning(setup, tmp_path):
    shards, model, _ = setup
    argv = run_argv(shards, model, tmp_path, "p", "--save-every-n-steps", "1", "--keep-last", "2")
    train_in_process([*argv, "--epochs", "1", "--keep-last", "4"])
    stuck = tmp_path / "p/checkpoints/step_1.pt"
    with undeletable(stuck):
        with pytest.raises(OSError):
            stuck.unlink()
        proc = subprocess.run(trainer_cmd(*argv, "--resume", "latest"), env=SUBPROCESS_ENV, capture_output=True,
                              text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Traceback" not in out, out[-3000:]
    warnings = [line for line in out.splitlines() if "WARNING" in line]
    assert warnings and all(f"cannot delete {stuck}" in line and "Operation not permitted" in line or
                            f"cannot delete {stuck}" in line and "busy" in line for line in warnings), warnings
    names = sorted(p.name for p in stuck.parent.iterdir())
    assert names == ["epoch_1.pt", "epoch_2.pt", "step_1.pt", "step_7.pt", "step_8.pt"], names
    assert len(warnings) == 1  # once, not at every save


@pytest.mark.parametrize("when", ["after launch (NAFLEX_ACCUM_LAUNCHED)", "after the process started",
                                  "before launch"])
def test_a_stop_file_written_after_launch_is_honoured(setup, tmp_path, when):
    """SLURM's USR1 can write STOP while the trainer starts: that request stops the run after its first step;
    only a STOP older than the launch (the earliest of the process start and $NAFLEX_ACCUM_LAUNCHED) is removed."""
    shards, model, _ = setup
    argv = run_argv(shards, model, tmp_path, "s", "--resume", "latest", epochs=1, samples=64, workers=0)
    stop = tmp_path / "s/STOP"
    stop.parent.mkdir()
    env = dict(SUBPROCESS_ENV)
    env.pop("NAFLEX_ACCUM_LAUNCHED", None)
    if when.startswith("after launch"):
        env["NAFLEX_ACCUM_LAUNCHED"] = str(int(time.time()) - 30)  # the launcher's clock, before the file
        stop.touch()
    elif when == "before launch":
        stop.touch()
        os.utime(stop, (time.time() - 60, time.time() - 60))
    proc = start(argv, tmp_path / "s.log", env=env)
    try:
        if when == "after the process started":
            stop.touch()  # the trainer is still importing torch: its start-up has not reached the STOP check
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = (tmp_path / "s.log").read_text()
    assert "Traceback" not in out, out[-3000:]
    if when == "before launch":
        assert proc.returncode == 0 and not stop.exists() and "Stopped on request" not in out, out[-3000:]
    else:
        assert proc.returncode == EXIT_STOPPED, out[-3000:]
        assert "Stopped on request (the STOP file) after step 1 of epoch 0" in out
        assert not stop.exists()  # answered: the next start does not meet it
