"""launch/slurm.sbatch and launch/slurm_srun.sbatch under a real SLURM: two nodes (node1, node2) on this machine.

scripts/slurm_cluster.sh brings munged, slurmctld and two slurmd up for this file and takes them down after it;
every real-SLURM test is in this one file, since the cluster's ports are fixed and ``make test`` runs one file
per process. It needs root (as CI runs): elsewhere the file skips with the reason, under CI it fails.

Each job is a real ``sbatch`` of a launch script, with the built-in trainer (upstream's through the runner in
one case) on the CPU. The trainer processes have tests/slurm_jobs/ first on PYTHONPATH: its sitecustomize
records every batch's sample keys per start and rank, and holds rank 0 before a given batch until the run's
STOP file (or the test's release file) exists, so that a signal lands inside a known step. A job's log must
read as events: every line is the script's own (time, job id, node count) or a SLURM daemon's one-line notice.
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
from longrun_common import SUBPROCESS_ENV, assert_identical, dropout_model, run_argv, weights
from upstream_real import DETERMINISTIC, _required, upstream_env

from naflex_accum.data import write_demo_data
from naflex_accum.upstream.tiny_tasks import write_model_dir

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "scripts" / "slurm_cluster.sh"
JOBS = ROOT / "tests" / "slurm_jobs"
SBATCH = ["--gpus-per-node=0", "--cpus-per-task=1"]
EVENT = re.compile(r"^\d{4}-\d\d-\d\dT\S+ job (\d+) on (\d) node\(s\): ")
SLURM_NOTICE = re.compile(r"^slurmstepd-node\d: error: \*\*\* (JOB|STEP) [\d.]+ ON node\d CANCELLED AT \S+( DUE TO "
                          r"(JOB REQUEUE|TIME LIMIT))? \*\*\*$")
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


@dataclass
class Job:
    id: str
    log: Path  # the job log (sbatch --output)
    run: Path  # the run folder, LOGS/NAME
    record: str  # the sitecustomize's file prefix
    env: dict

    def show(self) -> dict:
        out = subprocess.run(["scontrol", "-o", "show", "job", self.id], capture_output=True, text=True,
                             env=self.env, timeout=30).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def lines(self) -> list:
        return self.log.read_text().splitlines() if self.log.exists() else []

    def wait(self, what: str, ready, timeout: float):
        deadline = time.time() + timeout
        while not ready():
            if time.time() > deadline:
                pytest.fail(f"job {self.id}: no {what} within {timeout:g} s\n{self.report()}")
            time.sleep(0.1)

    def wait_line(self, text: str, timeout: float = 300) -> float:
        self.wait(f"'{text}' in the job log", lambda: any(text in line for line in self.lines()), timeout)
        return time.time()

    def wait_file(self, path, timeout: float = 300) -> None:
        self.wait(str(path), Path(path).exists, timeout)

    def wait_done(self, timeout: float = 600) -> dict:
        self.wait("end", lambda: self.show().get("JobState") in DONE, timeout)
        return self.show()

    def signal(self, *args) -> None:
        subprocess.run(["scancel", *args, self.id], check=True, env=self.env, timeout=30)

    def scontrol(self, *args) -> None:
        subprocess.run(["scontrol", *args], check=True, env=self.env, timeout=30)

    def out_log(self) -> str:
        return (self.run / "out.log").read_text()

    def node_logs(self) -> str:
        return "".join(p.read_text() for p in sorted((self.run / "nodes").glob("node-*.log")))

    def report(self) -> str:
        nodes = "".join(f"\n--- {p}\n" + "\n".join(p.read_text().splitlines()[-25:])
                        for p in sorted((self.run / "nodes").glob("*.log")))
        return f"{self.show()}\n--- job log\n" + "\n".join(self.lines()) + nodes

    def events(self) -> list:
        """The job log's lines without their time stamp; fails on any line that is not an event."""
        stray = [line for line in self.lines() if not (EVENT.match(line) or SLURM_NOTICE.match(line))]
        assert not stray, "not an event line in the job log:\n" + "\n".join(stray[:20])
        return [line.split(" ", 1)[1] for line in self.lines() if EVENT.match(line)]


class Cluster:
    def __init__(self, folder: Path):
        self.folder = folder
        self.env = {**SUBPROCESS_ENV, "SLURM_CONF": str(folder / "slurm.conf")}

    def sbatch(self, script: str, argv, *, name: str, nodes: str, opts=(), **env) -> Job:
        """``sbatch`` a launch script; ``env`` (PYTHON, LOGS, NAME, NGPU, ...) on top of this environment."""
        logs = self.folder / "logs"  # ./logs of the job's working directory: upstream's --logs default too
        record = str(self.folder / "records" / name)
        (self.folder / "records").mkdir(exist_ok=True)
        job_env = {**self.env, "PYTHON": sys.executable, "LOGS": str(logs), "NAME": name,
                   "NAFLEX_TEST_RECORD": record,
                   "PYTHONPATH": os.pathsep.join([str(JOBS), self.env["PYTHONPATH"]]), **env}
        log = self.folder / f"{name}.job.log"
        proc = subprocess.run(["sbatch", "--parsable", f"--nodes={nodes}", *SBATCH, f"--output={log}",
                               f"--chdir={self.folder}", f"--job-name={name}", *opts, str(ROOT / "launch" / script),
                               *map(str, argv)], capture_output=True, text=True, env=job_env, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return Job(proc.stdout.strip().split(";")[0], log, logs / name, record, self.env)


def _unavailable(reason: str):
    if _required():
        pytest.fail(f"{reason}; under CI the real-SLURM tests must run")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A two-node SLURM on this machine for this file; always taken down, however the tests end."""
    if os.geteuid() != 0:
        _unavailable("a real SLURM cluster needs root (its daemons, apt-get, node1/node2 in /etc/hosts)")
    if not all(map(shutil.which, ("slurmctld", "slurmd", "munged"))) and not shutil.which("apt-get"):
        _unavailable("slurm-wlm and munge are not installed, and there is no apt-get to install them")
    folder = tmp_path_factory.mktemp("slurm")
    try:
        up = subprocess.run(["bash", str(CLUSTER), "up", str(folder)], capture_output=True, text=True, timeout=900)
        if up.returncode != 0:
            _unavailable(f"scripts/slurm_cluster.sh up: {(up.stderr.strip().splitlines() or ['failed'])[-1]}")
        yield Cluster(folder)
    finally:
        env = {**os.environ, "SLURM_CONF": str(folder / "slurm.conf")}
        subprocess.run(["scancel", "--user", "root"], env=env, capture_output=True, timeout=30)
        for _ in range(600):  # the jobs' processes end with their job (SLURM's KillWait: 30 s)
            queue = subprocess.run(["squeue", "-h"], env=env, capture_output=True, text=True, timeout=30)
            if queue.returncode != 0 or not queue.stdout.strip():
                break
            time.sleep(0.1)
        subprocess.run(["bash", str(CLUSTER), "down", str(folder)], capture_output=True, timeout=120)


@pytest.fixture(autouse=True)
def no_job_left(cluster):
    """A test or fixture that failed may leave its job in the queue: it must not run into the next one."""
    yield
    subprocess.run(["scancel", "--user", "root"], env=cluster.env, timeout=30)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(shards, model json): 320 samples in 20 shards, an epoch of 256; naflex-tiny with patch dropout."""
    folder = tmp_path_factory.mktemp("slurm-data")
    data = write_demo_data(str(folder / "data"), num_samples=320, val_samples=16, shard_size=16, processes=1)
    return SimpleNamespace(train=data.train, val=data.val), dropout_model(folder)


def argv(setup, *extra):
    """2 microbatches of 8 samples per rank and step: at world size 4, 4 steps an epoch; 2: 8; 1: 16. A pause
    before batch 2 of an epoch (NAFLEX_TEST_PAUSE) lets a stop land after step 2."""
    shards, model = setup
    return run_argv(shards, model, None, None, "--check-every-n-steps", "1", "--naflex-max-tokens-per-batch", "128",
                    *extra, samples=256)


def samples(job: Job, epoch: int) -> list:
    """The sample keys every start and rank of ``job`` trained on in ``epoch``."""
    return [key for path in Path(job.record).parent.glob(f"{Path(job.record).name}-*-rank*.jsonl")
            for line in path.read_text().splitlines() for e, _, keys in [json.loads(line)] if e == epoch
            for key in keys]


def assert_epochs_exact(job: Job, reference: Job) -> None:
    for epoch in (0, 1):
        seen, whole = samples(job, epoch), samples(reference, epoch)
        assert len(whole) == len(set(whole)) == 256
        assert not [k for k, n in Counter(seen).items() if n > 1], f"epoch {epoch}: a sample trained twice"
        assert sorted(seen) == sorted(whole), f"epoch {epoch}: not the uninterrupted job's samples"


@pytest.fixture(scope="module")
def references(cluster, setup) -> dict:
    """The uninterrupted jobs (2 nodes x 2 processes, 2 nodes x 1), submitted at once: a node has 2 CPUs and a job
    takes one, so they run beside the first cases."""
    return {name: cluster.sbatch("slurm.sbatch", argv(setup), name=name, nodes="2", NGPU=ngpu)
            for name, ngpu in (("whole4", "2"), ("whole2", "1"))}


def finished(job: Job) -> Job:
    assert job.wait_done()["JobState"] == "COMPLETED", job.report()
    assert job.events()[-1].endswith("finished"), job.report()
    return job


@pytest.fixture(scope="module")
def whole4(references) -> Job:
    return finished(references["whole4"])


@pytest.fixture(scope="module")
def whole2(references) -> Job:
    return finished(references["whole2"])


@pytest.fixture(scope="module")
def preempted(cluster, setup, references) -> Job:
    """2 nodes x 2 processes: preempted (USR1 to the batch script) inside step 2 of epoch 0; the requeued start
    requeued by an admin (``scontrol requeue``) inside step 2 of epoch 1; the third start finishes."""
    job = cluster.sbatch("slurm.sbatch", argv(setup), name="preempted", nodes="2", NGPU="2",
                         NAFLEX_TEST_PAUSE="0:0:2,1:1:2")
    job.wait_file(f"{job.record}-paused-0")
    job.signal("-s", "USR1", "-b")
    job.wait_file(f"{job.record}-paused-1")
    job.scontrol("requeue", job.id)
    Path(f"{job.record}-release-1").touch()
    info = job.wait_done()
    assert (info["JobState"], info["Restarts"]) == ("COMPLETED", "2"), job.report()
    return job


def test_a_preempted_two_node_job_resumes_to_the_uninterrupted_weights(preempted, whole4):
    events = preempted.events()
    assert all(f"job {preempted.id} on 2 node(s): " in e for e in events)
    assert [e.split(": ", 1)[1].split(" ")[0] for e in events][:4] == ["start", "stop", "the", "requeueing:"], events
    assert "stop requested (SIGUSR1: time limit near, or preempted)" in events[1]
    assert re.search(r"the trainer saved and stopped: Stopped on request \(.*\) after step 2 of epoch 0: saved "
                     r"\S+/checkpoints/epoch_latest.pt; continue with --resume latest --name preempted \(exit 75\)$",
                     events[2]), events
    assert events[3].endswith("requeueing: the trainer saved after SIGUSR1")
    assert ": start 2: 2 process(es) per node" in events[4]
    # Bit for bit at world size 4 too: DDP keeps one bucket layout for the run (train/main.py), so the resumed
    # start's first step sums the 4 ranks' gradients in the uninterrupted job's order (with the layout DDP
    # rebuilds after its first step, they part by 2e-6).
    assert_identical(*(weights(job.run / "checkpoints/epoch_2.pt") for job in (preempted, whole4)))
    assert_epochs_exact(preempted, whole4)


def test_h_an_admins_requeue_continues_from_the_newest_checkpoint(preempted):
    events = [e.split(": ", 1)[1] for e in preempted.events()]
    assert events[4:] == [
        events[4], "SIGTERM from SLURM (a requeue, preemption, cancel or the time limit): the trainer saves and "
        "stops if it can", events[6], events[7], "finished"], events
    assert events[6].startswith("the trainer saved and stopped: Stopped on request (SIGTERM) after step 2 of "
                                "epoch 1: saved "), events
    assert events[7].startswith("start 3: ")
    resumed = re.findall(r"resumed from (\S+)", preempted.out_log())
    assert resumed[-1].endswith("checkpoints/epoch_latest.pt"), resumed
    assert re.search(r"Resumed --resume \S+/epoch_latest.pt at epoch 1, global step 6, step 2 of epoch 1",
                     preempted.node_logs())


@pytest.fixture(scope="module")
def shrunk(cluster, setup, whole2) -> Job:
    """``--nodes=1-2 --ntasks=2`` (2 nodes x 1 process: SLURM gives a range as many nodes as the job's tasks use)
    with a real time limit: 2 minutes, SIGUSR1 80 s before it. node2 is drained while it runs. SLURM requeues a
    job with the task count it had, so the requeued job waits for node2 until its task count is lowered (as a
    user does); it then comes back on node1 alone, at world size 1. (After ``whole2``, which needs node2.)"""
    job = cluster.sbatch("slurm.sbatch", argv(setup), name="shrunk", nodes="1-2", NGPU="1",
                         opts=["--ntasks=2", "--time=2", "--signal=B:USR1@80"], NAFLEX_TEST_PAUSE="0:0:2",
                         DATA_SLOTS="2")  # epoch 1 at world size 1 takes the order of the 2-rank job's
    try:
        job.wait("a start on 2 nodes", lambda: job.show().get("JobState") == "RUNNING", 120)
        assert job.show()["NumNodes"] == "2", job.report()
        job.scontrol("update", "nodename=node2", "state=drain", "reason=test")
        job.wait_line("stop requested", 120)  # SLURM's own signal: the test sends none
        job.scontrol("update", f"jobid={job.id}", "TimeLimit=10")  # the requeued start runs to its end
        job.wait("the requeue", lambda: [job.show().get(k) for k in ("JobState", "Restarts")] == ["PENDING", "1"],
                 120)
        job.scontrol("update", f"jobid={job.id}", "NumTasks=1")
        info = job.wait_done()
    finally:
        job.scontrol("update", "nodename=node2", "state=resume")
    assert (info["JobState"], info["Restarts"], info["NumNodes"]) == ("COMPLETED", "1", "1"), job.report()
    return job


def test_b_the_time_limits_signal_saves_and_requeues(shrunk):
    events = [e.split(": ", 1)[1] for e in shrunk.events()]
    assert events[1].startswith("stop requested (SIGUSR1: time limit near, or preempted)"), events
    assert re.match(r"the trainer saved and stopped: Stopped on request \(.*\) after step [12] of epoch 0: saved "
                    r"\S+/epoch_latest.pt", events[2]), events
    assert events[3] == "requeueing: the trainer saved after SIGUSR1"
    assert events[4].startswith("start 2: 1 process(es) per node") and events[5:] == ["finished"], events


def test_c_a_job_requeued_onto_one_node_goes_on_inside_its_epoch(shrunk, whole2):
    lines = shrunk.lines()
    assert " on 2 node(s): start 1: " in lines[0] and " on 1 node(s): start 2: " in lines[-2], lines
    assert re.search(r"Epoch 0 goes on at world size 1 \(saved at 2\) from global sample \d+: \d+ more steps",
                     shrunk.out_log()), shrunk.out_log()
    assert_epochs_exact(shrunk, whole2)


def node_processes(job: Job, node: str) -> list:
    """The pids of ``job``'s launcher (torchrun) on ``node`` and of every process under it."""
    def read(pid, name):
        try:
            return Path(f"/proc/{pid}/{name}").read_text()
        except OSError:  # gone meanwhile
            return ""

    pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    parents = {pid: int((read(pid, "stat").rsplit(")", 1) + [" ? 0"])[1].split()[1]) for pid in pids}
    tree = [pid for pid in pids if "torch.distributed.run" in read(pid, "cmdline")
            and {f"SLURM_JOB_ID={job.id}", f"SLURMD_NODENAME={node}"} <= set(read(pid, "environ").split("\0"))]
    assert len(tree) == 1, f"{node}: launchers {tree}"
    for pid in pids * 3:  # children, grandchildren (the loader workers)
        if parents.get(pid) in tree and pid not in tree:
            tree.append(pid)
    return tree


@pytest.fixture(scope="module")
def lost(cluster, setup) -> Job:
    """2 nodes x 1 process saving every step; node2 is lost inside step 3 of epoch 0: its launcher and the
    processes under it are killed with SIGKILL (on this one-machine cluster, SLURM's proctrack/linuxproc does not
    follow torchrun's workers once their parent is gone; on a real node they go with it)."""
    job = cluster.sbatch("slurm.sbatch", argv(setup, "--save-every-n-steps", "1"), name="lost", nodes="2",
                         NGPU="1", NAFLEX_TEST_PAUSE="0:0:4")
    job.wait_file(f"{job.record}-paused-0")
    for pid in node_processes(job, "node2"):
        os.kill(pid, signal.SIGKILL)
    job.killed = time.time()
    Path(f"{job.record}-release-0").touch()
    job.failed = job.wait_line("failed (exit 74)", 120)
    # the newest checkpoint when the job failed (the requeued start saves its first some 20 s later)
    job.saved = max((p.name for p in (job.run / "checkpoints").glob("step_*.pt")), key=lambda n: int(n[5:-3]))
    info = job.wait_done()
    assert (info["JobState"], info["Restarts"]) == ("COMPLETED", "1"), job.report()
    return job


def test_d_a_node_lost_mid_step_ends_every_rank_and_requeues_without_losing_a_checkpoint(lost, whole2):
    events = [e.split(": ", 1)[1] for e in lost.events()]
    assert lost.failed - lost.killed < 40, events
    # the rank that is gone, or (when it was rank 0, whose node's torchrun serves the job's store) that store
    assert re.match(r"failed \(exit 74\): naflex-accum train: error: (rank \d ended without a word|the job's store "
                    r"at \S+ \(torchrun's agent on rank 0's node\) closed|rank \d has not answered).* last good "
                    rf"checkpoint: \S+/{lost.saved}; run again with --resume latest --name lost \(exit 74\)$",
                    events[1]), events
    assert events[2] == "requeueing: exit 74 (a transient failure: the data loader, storage or a rank); restart 1 " \
                        "of LOADER_RETRIES=3", events
    assert events[3].startswith("start 2: ") and events[4:] == ["finished"], events
    assert re.search(rf"Resumed --resume \S+/checkpoints/{lost.saved} at epoch 0", lost.node_logs())
    assert_identical(weights(lost.run / "checkpoints/epoch_2.pt"), weights(whole2.run / "checkpoints/epoch_2.pt"))


def test_e_a_loader_failure_is_requeued_loader_retries_times(cluster):
    job = cluster.sbatch("slurm.sbatch", ["--train-data", "pipe:false", "--device", "cpu", "--workers", "0"],
                         name="loader", nodes="1", NGPU="1", LOADER_RETRIES="1")
    info = job.wait_done()
    assert (info["JobState"], info["Restarts"]) == ("FAILED", "1"), job.report()
    events = [e.split(": ", 1)[1] for e in job.events()]
    failure = "failed (exit 74): naflex-accum train: error: --train-data: cannot count the samples of 'pipe:false'"
    assert [e[:len(failure)] if e.startswith("failed") else e.split(":")[0] for e in events] == [
        "start 1", failure, "requeueing", "start 2", failure, "not requeueing"], events
    assert events[2] == "requeueing: exit 74 (a transient failure: the data loader, storage or a rank); restart 1 " \
                        "of LOADER_RETRIES=1"
    assert events[5] == "not requeueing: exit 74 again after 1 requeues (LOADER_RETRIES)"


def test_f_slurm_srun_sbatch_is_preempted_and_resumes_exactly(cluster, setup, whole2):
    job = cluster.sbatch("slurm_srun.sbatch", argv(setup), name="srun", nodes="2", opts=["--ntasks-per-node=1"],
                         NAFLEX_TEST_PAUSE="0:0:2")
    job.wait_file(f"{job.record}-paused-0")
    job.signal("-s", "USR1", "-b")
    info = job.wait_done()
    assert (info["JobState"], info["Restarts"]) == ("COMPLETED", "1"), job.report()
    events = [e.split(": ", 1)[1] for e in job.events()]
    assert events[0].startswith("start 1: 2 process(es) started by srun, master node1:")
    assert events[1].startswith("stop requested (SIGUSR1: time limit near, or preempted)")
    assert re.match(r"the trainer saved and stopped: Stopped on request \(.*\) after step 2 of epoch 0", events[2])
    assert events[3:] == ["requeueing: the trainer saved after SIGUSR1", events[4], "finished"]
    assert_identical(weights(job.run / "checkpoints/epoch_2.pt"), weights(whole2.run / "checkpoints/epoch_2.pt"))
    assert_epochs_exact(job, whole2)


def test_g_the_runner_on_upstream_is_requeued_and_resumes_from_its_checkpoint(cluster, upstream_src, demo_shards):
    model = write_model_dir(str(cluster.folder / "tiny-clip"), "clip")
    flags = ["--use-naflex", "--model", model, "--dataset-type", "webdataset", "--train-data", demo_shards,
             "--train-num-samples", "48", "--batch-size", "16", "--naflex-seq-lens", "16",
             "--naflex-max-tokens-per-batch", "256", "--accum-freq", "2", "--epochs", "3", "--workers", "0",
             "--lr", "1e-3", "--warmup", "0", "--device", "cpu", "--log-every-n-steps", "1"]
    env = {key: value for key, value in upstream_env(upstream_src, **DETERMINISTIC).items()
           if key in ("PYTHONPATH", *DETERMINISTIC)}
    env["PYTHONPATH"] = os.pathsep.join([str(JOBS), env["PYTHONPATH"]])
    job = cluster.sbatch("slurm.sbatch", flags, name="upstream", nodes="1", NGPU="1", TRAINER="openclip",
                         NAFLEX_TEST_PAUSE="0:2:0", **env)
    job.wait_file(f"{job.record}-paused-0")  # held at the start of epoch 2 (0-based), after saving epoch_2.pt
    job.signal("-s", "USR1", "-b")
    info = job.wait_done()
    assert (info["JobState"], info["Restarts"]) == ("COMPLETED", "1"), job.report()
    events = [e.split(": ", 1)[1] for e in job.events()]
    assert events[1] == "stop requested (SIGUSR1: time limit near, or preempted)", events
    assert events[2] == "requeueing: upstream's trainer has no stop request: it resumes from its newest checkpoint"
    assert not [e for e in events if e.startswith("failed")], events  # stopped for the requeue: no failure
    assert events[-2].startswith("start 2: ") and events[-1] == "finished", events
    log = job.out_log()
    assert re.search(r"=> resuming checkpoint '\S+/checkpoints/epoch_2.pt' \(epoch 2\)", log), log[-2000:]
    assert (job.run / "checkpoints/epoch_3.pt").is_file()
