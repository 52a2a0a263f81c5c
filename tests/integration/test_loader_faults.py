"""A data-loader worker that dies, raises or stops answering ends the run promptly, in one line, exit 74.

The real thing in a subprocess (``loader_jobs/faulty_trainer.py`` around ``naflex-accum
train``): a worker killed with SIGKILL (what the OOM killer sends), over both hand-over
paths (recycled shared-memory slots, fresh shared memory) with 1 and 2 workers (and a worker
killed while its batch is read, before it can be reaped: ``loader_jobs/lost_mid_read.py``); a worker
that raises; a worker frozen with SIGSTOP under ``--data-timeout``. Each run must exit 74
within seconds with one error line naming the worker, print no traceback, and leave its
last checkpoint loadable. Every subprocess has a timeout.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from longrun_common import SUBPROCESS_ENV, dropout_model, make_shards, run_argv

JOB = Path(__file__).resolve().parents[1] / "loader_jobs" / "faulty_trainer.py"

EXIT_LOADER = 74

PROMPT = 20.0  # seconds from the fault to the exit, at most (torch notices a dead worker within 5 s)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("loader-faults")
    return make_shards(folder), dropout_model(folder)


def _start(setup, tmp_path, handover, workers, *extra, job_opts=()):
    shards, model = setup
    argv = run_argv(shards, model, tmp_path, "run", "--save-every-n-steps", "1", *extra, epochs=50,
                    workers=workers)
    log = open(tmp_path / "out.txt", "w")
    proc = subprocess.Popen([sys.executable, str(JOB), handover, *job_opts, "--", *argv], env=SUBPROCESS_ENV,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc


def _workers_of(proc, count, timeout=60.0):
    """The loader workers' pids, once all ``count`` exist."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        pids = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        if len(pids) >= count:
            return [int(p) for p in pids]
        time.sleep(0.05)
    raise AssertionError(f"no {count} loader workers (exit {proc.poll()})")


def _wait_for_step(tmp_path, proc, timeout=60.0):
    deadline = time.time() + timeout
    while not list((tmp_path / "run" / "checkpoints").glob("step_*.pt")):
        assert proc.poll() is None and time.time() < deadline, (tmp_path / "out.txt").read_text()[-3000:]
        time.sleep(0.05)


def _ended(proc, tmp_path, since):
    try:
        code = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"still running 120 s after the fault:\n{(tmp_path / 'out.txt').read_text()[-3000:]}")
    took = time.time() - since
    out = (tmp_path / "out.txt").read_text()
    errors = [line for line in out.splitlines() if "| ERROR |" in line]
    return code, took, out, errors


def _last_checkpoint_loads(line):
    path = line.split("last good checkpoint: ", 1)[1].split(";", 1)[0]
    payload = torch.load(path, map_location="cpu", weights_only=False)
    assert payload["state_dict"] and payload["global_step"] >= 1


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("handover", ["slots", "fresh"])
def test_a_killed_worker_ends_the_run_within_seconds(setup, tmp_path, handover, workers):
    proc = _start(setup, tmp_path, handover, workers)
    try:
        _wait_for_step(tmp_path, proc)
        victim = _workers_of(proc, workers)[-1]
        os.kill(victim, signal.SIGKILL)
        code, took, out, errors = _ended(proc, tmp_path, time.time())
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert code == EXIT_LOADER and took < PROMPT, (code, took, out[-3000:])
    assert len(errors) == 1 and "Traceback" not in out, out[-3000:]
    assert f"Data loader failed on rank 0: loader worker {workers - 1} of {workers} (pid {victim}) was killed by " \
           f"SIGKILL" in errors[0]
    assert errors[0].endswith(f"run again with --resume latest --name run (exit {EXIT_LOADER})")
    _last_checkpoint_loads(errors[0])


def test_a_worker_that_raises_ends_the_run_in_one_line(setup, tmp_path):
    proc = _start(setup, tmp_path, "slots", 2, job_opts=("raise-at=12",))
    code, took, out, errors = _ended(proc, tmp_path, time.time())
    assert code == EXIT_LOADER and "Traceback" not in out, out[-3000:]
    assert len(errors) == 1 and "raised ValueError: injected failure while building batch 12 of this worker" \
        in errors[0], errors
    _last_checkpoint_loads(errors[0])


def test_a_worker_that_stops_answering_ends_the_run_after_the_timeout(setup, tmp_path):
    proc = _start(setup, tmp_path, "slots", 2, "--data-timeout", "3")
    try:
        _wait_for_step(tmp_path, proc)
        for pid in _workers_of(proc, 2):
            os.kill(pid, signal.SIGSTOP)  # both frozen: no batch can come
        code, took, out, errors = _ended(proc, tmp_path, time.time())
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert code == EXIT_LOADER and took < 3 + PROMPT, (code, took, out[-3000:])
    assert len(errors) == 1 and "the loader workers sent no batch for 3 s (--data-timeout)" in errors[0], errors
    assert "Traceback" not in out
    leftover = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert not leftover  # the frozen workers were killed, not left behind


def test_a_worker_death_reported_mid_log_is_raised_at_the_next_batch():
    """Red before: the report raised inside logging, which printed a traceback and dropped it."""
    job = Path(__file__).resolve().parents[1] / "loader_jobs" / "sigchld_mid_log.py"
    done = subprocess.run([sys.executable, str(job)], env=SUBPROCESS_ENV, capture_output=True, text=True,
                          timeout=120)
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "Traceback" not in out and "Logging error" not in out, out
    assert "record: formatted" in out, out
    assert "next batch: raised DataLoader worker (pid 12345) is killed by signal" in out, out
    assert "in a batch wait: raised DataLoader worker (pid 12345)" in out, out


def test_a_worker_killed_mid_read_is_named_not_reported_as_a_connection_reset():
    """Red before: a read that failed before torch could see the worker dead ended the run with a traceback."""
    job = Path(__file__).resolve().parents[1] / "loader_jobs" / "lost_mid_read.py"
    done = subprocess.run([sys.executable, str(job)], env=SUBPROCESS_ENV, capture_output=True, text=True,
                          timeout=120)
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "Traceback" not in out, out
    assert "killed: failure: loader worker 0 of 1 (pid " in out and "was killed by SIGKILL" in out, out
    assert "alive: raised ConnectionResetError" in out and "alive: failure: None" in out, out
    assert "pinned: failure: loader worker 0 of 1 (pid " in out, out


def test_workers_started_by_a_thread_that_ends_live_on():
    """Linux's parent-death signal, which kills a worker with its process, fires when the thread that forked the
    worker ends: a loader first iterated in a thread that then ends keeps its workers (red when they take it)."""
    import threading

    from naflex_accum.data.delivery import torch_loader

    loader, box = torch_loader(list(range(6)), workers=1, pin_memory=False, persistent=True), {}

    def first():  # the worker has started (and armed the signal, if it takes it) once its first batch is here
        box["batches"] = iter(loader)
        box["first"] = next(box["batches"])
    thread = threading.Thread(target=first)
    thread.start()
    thread.join()
    time.sleep(0.5)  # the signal, had the worker taken it, has come by now
    assert [box["first"], *box["batches"]] == list(range(6))


def test_a_forkserver_loader_delivers_every_batch(monkeypatch):
    """Under forkserver (Python 3.14's default on Linux) a worker's parent is the server, not the loader's process:
    it takes no parent-death signal (red: every worker exited 1 as it started)."""
    import multiprocessing

    from naflex_accum.data.delivery import torch_loader

    default = multiprocessing.get_context
    monkeypatch.setattr(multiprocessing, "get_context", lambda method=None: default(method or "forkserver"))
    assert list(torch_loader(list(range(6)), workers=1, pin_memory=False)) == list(range(6))


def test_stopping_workers_one_of_which_was_killed_holding_their_done_events_lock_returns():
    """A worker killed inside ``done_event.is_set()`` (the event's lock held) hung the shutdown that followed for
    ever (a fresh-clone run's test_data_epochs stopped there, torch's ``_workers_done_event.set()``)."""
    import multiprocessing
    import threading

    from naflex_accum.data import workers
    from naflex_accum.data.delivery import torch_loader

    loader = torch_loader(list(range(64)), workers=2, pin_memory=False, persistent=True)
    iterator = iter(loader)
    workers.register(iterator, workers.of(loader))
    next(iterator)
    holder = multiprocessing.get_context("fork").Process(target=lambda: iterator._workers_done_event._cond.acquire()
                                                         or time.sleep(60))  # stands for a worker inside is_set()
    holder.start()
    time.sleep(1.0)
    holder.kill()
    holder.join()
    stopping = threading.Thread(target=workers.stop, args=(workers.of(loader),), daemon=True)
    stopping.start()
    stopping.join(30)
    assert not stopping.is_alive(), "stopping the workers hangs on the done event's lock"
