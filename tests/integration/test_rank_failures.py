"""A rank that fails, freezes or is killed ends every rank of the run, in one line, in its exit class.

The real thing: torchrun (--standalone, gloo, CPU, 2 processes; each rank's output redirected by torchrun to
files of its own) around ``naflex-accum train`` (``loader_jobs/rank_faults.py``), and two processes started
the way srun starts them (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), where rank 0 serves the job's store
itself, as env:// has it. Faults: a bad flag on every rank, rank 0 the last to parse it; rank 1 alone raises
(its data loader cannot start, or its images stop decoding mid-run); a bug on rank 1 (torchrun's summary shows
it, through the rank's error file); rank 1 frozen with SIGSTOP; rank 1 killed with SIGKILL; torchrun's agent
killed with SIGKILL; rank 1 frozen while rank 0 gets SIGTERM; rank 0 killed, or frozen, under srun (its store
goes with it: rank 1 says so); rank 0's checkpoint write slower than any collective may wait, with SIGTERM to
every rank during it. The line must reach the user once, on rank 0's stderr (and in out.log once it exists; rank
1's when rank 0 is gone); no rank may print a traceback or a connection error.
Every subprocess has a timeout; times are asserted only as generous bounds on a hang.
"""

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from longrun_common import SUBPROCESS_ENV, dropout_model, make_shards, run_argv

from naflex_accum.train.ending.liveness import ACK_WAIT

JOB = Path(__file__).resolve().parents[1] / "loader_jobs" / "rank_faults.py"

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]

NOISE = ("Traceback", "Connection reset", "Connection closed", "/gloo/", "Exception raised from", "DistNetworkError",
         "watchdog met", "Exception ignored")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("rank-failures")
    return make_shards(folder), dropout_model(folder)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    """One 2-rank run of ``rank_faults.py``: under torchrun, or as srun starts the ranks (``srun=True``)."""

    def __init__(self, tmp_path, setup, *extra, srun=False, epochs=50, **env):
        shards, model = setup
        self.tmp, self.srun, self.record = tmp_path, srun, tmp_path / "rec"
        self.record.mkdir()
        argv = run_argv(shards, model, tmp_path / "logs", "run", "--save-every-n-steps", "1", *extra,
                        epochs=epochs, workers=1)
        env = {**SUBPROCESS_ENV, "RECORD": str(self.record), **env}
        self.out = open(tmp_path / "launcher.txt", "w")
        if srun:
            self.port = _free_port()
            port = str(self.port)
            self.procs = [subprocess.Popen(
                [sys.executable, str(JOB), *argv], start_new_session=True,
                stdout=open(tmp_path / f"rank{r}.stdout", "w"), stderr=open(tmp_path / f"rank{r}.stderr", "w"),
                env={**env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                     "MASTER_PORT": port}) for r in (0, 1)]
        else:
            self.procs = [subprocess.Popen([*TORCHRUN, "--redirects", "3", "--log-dir", str(tmp_path / "tl"),
                                            str(JOB), *argv], env=env, stdout=self.out, stderr=subprocess.STDOUT,
                                           start_new_session=True)]

    def pid(self, rank: int) -> int:
        return int((self.record / f"rank{rank}.pid").read_text())

    def wait_steps(self, rank: int, steps: int, timeout=120.0) -> None:
        marker, deadline = self.record / f"rank{rank}.steps", time.time() + timeout
        while int((marker.read_text() if marker.exists() else "") or 0) < steps:  # one read: the file is rewritten
            assert time.time() < deadline and all(p.poll() is None for p in self.procs), self.report()
            time.sleep(0.05)

    def rank_ended(self, rank: int) -> bool:
        try:
            return Path(f"/proc/{self.pid(rank)}/stat").read_text().split(")")[-1].split()[0] == "Z"
        except FileNotFoundError:
            return True

    def wait_rank(self, rank: int, deadline: float) -> float:
        """When ``rank`` ended (fails the test past ``deadline``)."""
        while not self.rank_ended(rank):
            if time.time() > deadline:
                self.kill()
                pytest.fail(f"rank {rank} still running past its deadline\n{self.report()}")
            time.sleep(0.05)
        return time.time()

    def wait(self, timeout=90.0) -> dict:
        """Each rank's exit status (torchrun's summary names each failed rank's)."""
        try:
            for p in self.procs:
                p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"still running {timeout:g} s on\n{self.report()}")
        if self.srun:
            return {r: p.returncode for r, p in enumerate(self.procs)}
        found = re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", self.launcher())
        return {int(r): int(code) for r, code in found}

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for rank in (0, 1):
            try:
                os.kill(self.pid(rank), signal.SIGKILL)
            except (OSError, ValueError):
                pass

    def launcher(self) -> str:
        self.out.flush()
        return (self.tmp / "launcher.txt").read_text()

    def output(self, rank: int, stream: str) -> str:
        if self.srun:
            return (self.tmp / f"rank{rank}.{stream}").read_text()
        found = list((self.tmp / "tl").glob(f"*/attempt_0/{rank}/{stream}.log"))
        return found[0].read_text() if found else ""

    def outputs(self) -> str:
        return "".join(self.output(r, s) for r in (0, 1) for s in ("stdout", "stderr"))

    def out_log(self) -> str:
        path = self.tmp / "logs" / "run" / "out.log"
        return path.read_text() if path.exists() else ""

    def report(self) -> str:
        return "\n".join(f"--- rank {r} {s}:\n{self.output(r, s)[-2500:]}" for r in (0, 1)
                         for s in ("stdout", "stderr")) + f"\n--- launcher:\n{self.launcher()[-2500:]}"


def heard_once(job: Job, text: str, logged: bool = True) -> str:
    """The one line holding ``text``: once in the ranks' output (rank 0's stderr) and once in out.log
    (``logged``; a failure before rank 0 made the run folder has none)."""
    everything = job.outputs()
    assert everything.count(text) == 1, job.report()
    line = next(line for line in job.output(0, "stderr").splitlines() if text in line)
    assert line.startswith("naflex-accum train: error: "), line
    in_log = job.out_log().count(text)
    assert in_log == 1 if logged else in_log <= 1, job.out_log()[-2000:]
    assert not [n for n in NOISE if n in everything], job.report()
    return line


def last_checkpoint_loads(line: str) -> None:
    path = line.split("last good checkpoint: ", 1)[1].split(";", 1)[0]
    assert torch.load(path, map_location="cpu", weights_only=True)["global_step"] >= 1


@pytest.mark.parametrize("when", ["at start-up", "mid-run"])
def test_an_error_on_rank_1_alone_reaches_the_user_once_and_every_rank_exits_2(setup, tmp_path, when):
    if when == "at start-up":  # rank 0 is in its first collective, or making the run folder
        job = Job(tmp_path, setup, FAIL_AT_START="1")
        text = "rank 1: --train-data: rank 1's shards cannot be read (injected)"
    else:
        job = Job(tmp_path, setup, BREAK_RANK="1", BREAK_AFTER="150")
        text = "rank 1: --train-data: 5 images in a row failed to decode"
    assert job.wait() == {0: 2, 1: 2}, job.report()
    heard_once(job, text, logged=when == "mid-run")
    assert "(injected)" not in job.output(1, "stdout") + job.output(1, "stderr")
    if when == "mid-run":
        assert list((tmp_path / "logs/run/checkpoints").glob("step_*.pt"))  # it trained before it broke


def test_a_bad_flag_on_every_rank_is_one_line_from_rank_0_and_every_rank_exits_2(setup, tmp_path):
    job = Job(tmp_path, setup, "--epochs", "-3", LATE="3")  # rank 0 parses last, as on a slower node
    assert job.wait() == {0: 2, 1: 2}, job.report()
    heard_once(job, "naflex-accum train: error: --epochs must be a positive integer, got -3", logged=False)


def test_ranks_launched_with_other_flags_are_refused_in_one_line_before_the_run_folder_exit_2(setup, tmp_path):
    """An --accum-freq of its own made rank 1's first collective disagree in size with rank 0's (gloo aborted)."""
    job = Job(tmp_path, setup, RANK_1_FLAGS="--accum-freq 4 --lr 0.01")
    assert job.wait() == {0: 2, 1: 2}, job.report()
    heard_once(job, "rank 1's flags differ from rank 0's: --accum-freq 4 (rank 0: 2), --lr 0.01 (rank 0: 0.001); "
                    "launch every rank with the same flags", logged=False)
    assert not (tmp_path / "logs/run").exists()


def test_a_bug_on_rank_1_is_torchruns_root_cause_with_its_error_and_traceback(setup, tmp_path):
    job = Job(tmp_path, setup, FAIL_AT_START="bug:1")
    assert job.wait() == {0: 1, 1: 1}, job.report()
    line = "rank 1 failed: TypeError: an injected bug (a bug: the traceback is in rank 1's output)"
    assert [l for l in job.output(0, "stderr").splitlines() if l.strip()] == [f"naflex-accum train: error: {line}"]
    root_cause = job.launcher().split("Root Cause", 1)[1]  # torchrun's summary, from the rank's error file
    assert re.search(r"rank\s*:\s*1 ", root_cause) and "TypeError: an injected bug" in root_cause, job.launcher()
    assert "Traceback" in root_cause and "in build_data" in root_cause, job.launcher()


def test_a_frozen_rank_ends_the_job_within_the_dist_timeout_exit_74(setup, tmp_path):
    timeout = 6
    job = Job(tmp_path, setup, "--dist-timeout", str(timeout))
    job.wait_steps(1, 2)
    frozen = time.time()
    os.kill(job.pid(1), signal.SIGSTOP)
    ended = job.wait_rank(0, frozen + timeout + 20)
    os.kill(job.pid(1), signal.SIGCONT)  # as a process stuck in the kernel comes back: it ends at once too
    codes = job.wait(timeout=60)
    print(f"rank 0 ended {ended - frozen:.1f} s after rank 1 froze")
    assert codes == {0: 74, 1: 74}, job.report()
    line = heard_once(job, "rank 1 stopped answering: a collective waited --dist-timeout (6 s) and a roll call 8 s")
    last_checkpoint_loads(line)


def test_ranks_that_end_without_a_word_leave_the_requeue_class_in_the_exit_file(setup, tmp_path):
    # NCCL's watchdog ends every process waiting in a collective past --dist-timeout with SIGABRT: no trainer
    # code runs, so what each rank wrote once its process group was up is what launch/slurm.sbatch reads
    exit_file = tmp_path / "exit"
    job = Job(tmp_path, setup, NAFLEX_ACCUM_EXIT_FILE=str(exit_file))
    job.wait_steps(0, 1)
    job.wait_steps(1, 1)
    for rank in (0, 1):
        os.kill(job.pid(rank), signal.SIGABRT)
    assert job.wait(timeout=60) == {0: -signal.SIGABRT, 1: -signal.SIGABRT}, job.report()
    code, line = exit_file.read_text().splitlines()
    assert code == "74" and "ended without a word: killed, or ended by NCCL's watchdog" in line, line


def test_a_killed_rank_ends_the_others_with_one_line_exit_74(setup, tmp_path):
    job = Job(tmp_path, setup)
    job.wait_steps(1, 2)
    killed = time.time()
    os.kill(job.pid(1), signal.SIGKILL)
    job.wait_rank(0, killed + 40)
    codes = job.wait(timeout=60)
    assert codes[0] == 74 and codes[1] == -signal.SIGKILL, job.report()
    # rank 0's broken collective, or torchrun's SIGTERM that follows at once, starts the roll call that names it
    text = "rank 1 ended without a word (killed?" if "rank 1 ended" in job.outputs() else "rank 1 has not answered"
    last_checkpoint_loads(heard_once(job, text))


def test_torchruns_agent_killed_ends_every_rank_at_its_next_step_naming_its_last_checkpoint(setup, tmp_path):
    # the ranks' collectives do not need the store, so they would train (and save) on while the listener, which
    # found the store closed, waits for the main thread: it must stop at its next step, and its line must name
    # the last checkpoint (or one a step before it, when a step's saves were under way as the store closed)
    exit_file = tmp_path / "exit"
    job = Job(tmp_path, setup, NAFLEX_ACCUM_EXIT_FILE=str(exit_file))
    job.wait_steps(0, 3)
    killed = time.time()
    os.kill(job.procs[0].pid, signal.SIGKILL)
    job.procs[0].wait()
    for rank in (0, 1):
        job.wait_rank(rank, killed + 40)
    line = heard_once(job, "(torchrun's agent on rank 0's node) closed: the launcher or the job ended around this rank")
    named = Path(line.split("last good checkpoint: ", 1)[1].split(";", 1)[0])
    step = {p: torch.load(p, map_location="cpu", weights_only=True)["global_step"]  # step_N.pt, epoch_N.pt
            for p in (tmp_path / "logs/run/checkpoints").glob("*.pt")}
    assert named in step and step[named] >= sorted(set(step.values()))[-2], (named, step)  # (pruned: stale)
    assert exit_file.read_text().splitlines()[0] == "74"


def test_sigterm_to_a_rank_waiting_on_a_frozen_peer_ends_it_at_once(setup, tmp_path):
    timeout = 300  # far beyond this test: the SIGTERM, not the timeout, must end it
    job = Job(tmp_path, setup, "--dist-timeout", str(timeout))
    job.wait_steps(1, 2)
    os.kill(job.pid(1), signal.SIGSTOP)
    time.sleep(2)
    asked = time.time()
    os.kill(job.pid(0), signal.SIGTERM)
    ended = job.wait_rank(0, asked + 40)
    os.kill(job.pid(1), signal.SIGCONT)
    codes = job.wait(timeout=60)
    print(f"rank 0 ended {ended - asked:.1f} s after its SIGTERM")
    assert codes == {0: 74, 1: 74}, job.report()
    line = heard_once(job, "and rank 0 got SIGTERM: nothing can be saved without every rank")
    assert line.split(": error: ")[1].startswith("rank 1 has not answered"), line
    last_checkpoint_loads(line)


def test_srun_rank_0_killed_rank_1_says_so_at_once_exit_74(setup, tmp_path):
    """Killed while its loader worker is inside a read that does not end: the worker, orphaned and blocked, must
    not keep rank 0's connections (the job's store it serves) open; else rank 1 waits for them and then takes
    rank 0 for frozen."""
    stall, stalled = tmp_path / "stall.0", tmp_path / "stalled.pid"  # rank 0's reads hang while stall.0 is there
    (tmp_path / "read.sh").write_text(f'if [ -e {tmp_path}/stall.$RANK ]; then echo $$ > {stalled}; exec sleep 600; fi\n'
                                      f'exec cat "$1"\n')
    job = Job(tmp_path, setup, "--train-data", f"pipe:bash {tmp_path / 'read.sh'} {setup[0].train}", srun=True)
    job.wait_steps(0, 2)
    stall.touch()
    deadline = time.time() + 60
    while not stalled.exists() and time.time() < deadline:  # the worker's next shard read: an epoch on
        time.sleep(0.1)
    assert stalled.exists(), job.report()
    killed = time.time()
    os.kill(job.pid(0), signal.SIGKILL)
    try:
        job.wait_rank(1, killed + 40)
        codes = job.wait(timeout=60)
    finally:  # the orphaned worker reads on, no longer stalled, and ends
        stall.unlink()
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(stalled.read_text()), signal.SIGKILL)
    assert codes == {0: -signal.SIGKILL, 1: 74}, job.report()
    err = job.output(1, "stderr")
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "rank 0 ended without a word" in lines[0], job.report()
    assert not [n for n in NOISE if n in job.outputs()], job.report()


def test_a_frozen_srun_rank_0_is_named_one_store_wait_after_the_dist_timeout_exit_74(setup, tmp_path):
    """Under srun rank 0 serves the job's store, which freezes with it: rank 1 waits out its collective and then one
    store call (``ACK_WAIT``), not one for each call it would make (about 20 s more)."""
    timeout = 6
    job = Job(tmp_path, setup, "--dist-timeout", str(timeout), srun=True)
    job.wait_steps(1, 2)
    frozen = time.time()
    os.kill(job.pid(0), signal.SIGSTOP)
    try:
        ended = job.wait_rank(1, frozen + timeout + ACK_WAIT + 5)
    finally:
        os.kill(job.pid(0), signal.SIGCONT)
    codes = job.wait(timeout=60)
    print(f"rank 1 ended {ended - frozen:.1f} s after rank 0 froze")
    assert codes == {0: 74, 1: 74}, job.report()
    lines = [line for line in job.output(1, "stderr").splitlines() if line.strip()]
    assert len(lines) == 1 and "rank 0 stopped answering: the job's store it serves gave no answer for 10 s (a " \
                               "stopped or frozen process)" in lines[0], job.report()
    last_checkpoint_loads(lines[0])


def test_rank_0s_checkpoint_write_longer_than_a_collective_may_wait_and_a_sigterm_to_all_then_stop_cleanly(setup,
                                                                                                          tmp_path):
    # --dist-timeout 5: a collective waits at most 5 s once the first step has ended; rank 0's first checkpoint
    # write takes 38 s more (the others wait for it under the solo phases' timeout). SIGTERM reaches both ranks as
    # it begins, as SLURM signals every task: both take a roll call at once, and each must hear the other (not
    # take it for frozen), so the run stops on request once the write is done. Under srun, where rank 0 serves
    # the store until rank 1 is done with it, and nothing serves its port after the run.
    job = Job(tmp_path, setup, "--dist-timeout", "5", srun=True, epochs=1, SLOW="38")
    started, deadline = job.record / "slow.started", time.time() + 120
    while not started.exists():
        assert time.time() < deadline and all(p.poll() is None for p in job.procs), job.report()
        time.sleep(0.05)
    time.sleep(1)
    for rank in (0, 1):
        os.kill(job.pid(rank), signal.SIGTERM)
    assert job.wait(timeout=150) == {0: 75, 1: 75}, job.report()
    assert job.output(0, "stderr") == job.output(1, "stderr") == "", job.report()
    assert "ERROR" not in job.out_log() and (tmp_path / "logs/run/checkpoints/step_1.pt").exists(), job.report()
    deadline = time.time() + 30
    while True:  # nothing serves the store's port once the run is over
        try:
            socket.create_connection(("127.0.0.1", job.port), timeout=2).close()
        except ConnectionRefusedError:
            break
        assert time.time() < deadline, f"port {job.port} still served 30 s after the run"
        time.sleep(0.2)
