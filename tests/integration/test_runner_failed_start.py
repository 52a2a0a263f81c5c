"""A start of upstream's ``main`` that fails before its first step leaves nothing that blocks its retry.

``upstream_jobs/failing_start.py`` runs ``naflex_accum.openclip`` on the pinned
upstream with a failure put into upstream's ``main``: its data set-up raises
(after the run folder and the model, before the first step), or its
``train_one_epoch`` raises after an epoch. Before the first step the runner
must say upstream's error in one line (exit 1, no traceback on the console),
remove the run folder this start made and nothing else, so the same ``--name``
starts again; a folder that was there before is kept, with the traceback in its
``out.log``; a file a user wrote into the run folder while it started keeps
the folder. Two starts with the same ``--name`` at once: the one upstream
refuses ("Experiment already exists") takes nothing from the other, which
trains on. After the first step everything stays as upstream leaves it. Two
CPU ranks (upstream's DDP wrap fails on each, before the first step): each rank
says its line, and the rank that made the folder removes it.
"""
import re
import socket
import subprocess
import sys
import time

import pytest
from upstream_real import DETERMINISTIC, JOBS, run_python, tail, upstream_env

from naflex_accum.upstream.tiny_tasks import write_model_dir

ERROR = "naflex_accum.openclip: error: upstream's main stopped before its first step"
INJECTED = "RuntimeError: injected: the data set-up failed (a second line of the message)"
REMOVED = "removed the run folder {} this start had created, so the same --name can start again"
TIMEOUT = 300
# torch's own records at exit (dynamo's compile metrics, on 5964c41, under the INFO level upstream sets), as in any run
TORCH_AT_EXIT = re.compile(r"^[DIWE]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S*torch/")  # torch at exit (5964c41)

pytestmark = pytest.mark.timeout(600)  # the longest, a failed start then a training run, takes ~40 s


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model_dir(str(tmp_path_factory.mktemp("failed-start") / "tiny-clip"), "clip")


def _args(demo_shards, model, *more):
    return ["--model", model, "--batch-size", "4", "--accum-freq", "2", "--epochs", "1", "--lr", "1e-3", "--warmup",
            "0", "--train-data", demo_shards, "--dataset-type", "webdataset", "--train-num-samples", "8",
            "--workers", "0", "--device", "cpu", "--logs", "logs", "--name", "run", *more]


def _start(src, args, cwd, fail_at=None, job=True):
    head = [JOBS / "failing_start.py"] if job else ["-m", "naflex_accum.openclip"]
    return run_python(src, [*head, *args], cwd=cwd, timeout=TIMEOUT,
                      env=upstream_env(src, FAIL_AT=fail_at, NAFLEX_ACCUM_MODE=None, NAFLEX_ACCUM_VERIFY=None,
                                       **DETERMINISTIC))


def _one_line(proc, *said) -> str:
    """The failed start's one line: exit 1, the last line on stderr, the only error, no traceback anywhere."""
    assert proc.returncode == 1, tail(proc)
    assert "Traceback" not in proc.stderr + proc.stdout, tail(proc)
    lines = [line for line in proc.stderr.strip().splitlines() if not TORCH_AT_EXIT.match(line)]
    errors = [line for line in lines if "error:" in line]
    assert len(errors) == 1 and errors[0] == lines[-1], tail(proc)
    assert errors[0].startswith(ERROR) and all(text in errors[0] for text in said), errors[0]
    return errors[0]


def test_a_failure_before_the_first_step_leaves_nothing_and_the_same_name_starts_again(pinned, demo_shards, model,
                                                                                       tmp_path):
    proc = _start(pinned.src, _args(demo_shards, model), tmp_path, fail_at="get_data")
    _one_line(proc, f": {INJECTED} (upstream_jobs/failing_start.py:", REMOVED.format("logs/run"))
    assert not (tmp_path / "logs").exists(), sorted((tmp_path / "logs").rglob("*"))
    again = _start(pinned.src, _args(demo_shards, model), tmp_path, job=False)
    assert again.returncode == 0, tail(again)
    assert (tmp_path / "logs" / "run" / "checkpoints" / "epoch_1.pt").is_file()


def test_only_the_folder_this_start_made_goes(upstream_src, demo_shards, model, tmp_path):
    earlier = tmp_path / "logs" / "earlier" / "checkpoints"
    earlier.mkdir(parents=True)
    (earlier / "epoch_1.pt").write_bytes(b"an earlier run's")
    proc = _start(upstream_src, _args(demo_shards, model), tmp_path, fail_at="get_data")
    _one_line(proc, REMOVED.format("logs/run"))
    assert sorted(p.relative_to(tmp_path).as_posix() for p in (tmp_path / "logs").rglob("*")) == [
        "logs/earlier", "logs/earlier/checkpoints", "logs/earlier/checkpoints/epoch_1.pt"]


def test_a_run_folder_that_was_there_before_is_kept_with_the_traceback_in_its_log(upstream_src, demo_shards, model,
                                                                                   tmp_path):
    folder = tmp_path / "logs" / "run"
    (folder / "checkpoints").mkdir(parents=True)
    (folder / "checkpoints" / "epoch_1.pt").write_bytes(b"an earlier run's")
    (folder / "notes.txt").write_text("mine")
    proc = _start(upstream_src, _args(demo_shards, model), tmp_path, fail_at="get_data")
    _one_line(proc, INJECTED, f"the run folder logs/run was there before this start and is kept (the traceback is "
                              f"in {folder / 'out.log'})")
    assert (folder / "checkpoints" / "epoch_1.pt").read_bytes() == b"an earlier run's"
    assert (folder / "notes.txt").read_text() == "mine"
    log = (folder / "out.log").read_text()
    assert "Traceback" in log and "injected: the data set-up failed" in log


def test_a_file_written_into_the_run_folder_while_it_starts_is_kept(upstream_src, demo_shards, model, tmp_path):
    proc = _start(upstream_src, _args(demo_shards, model), tmp_path, fail_at="get_data_after_notes")
    _one_line(proc, INJECTED, "the run folder logs/run is kept: it holds NOTES.txt (this start's out.log and "
                              "params.txt are removed, so the same --name can start again)")
    assert sorted(p.relative_to(tmp_path).as_posix() for p in (tmp_path / "logs").rglob("*")) == [
        "logs/run", "logs/run/NOTES.txt"]
    again = _start(upstream_src, _args(demo_shards, model), tmp_path, job=False)
    assert again.returncode == 0, tail(again)
    assert (tmp_path / "logs" / "run" / "NOTES.txt").read_text() == "mine"


def test_of_two_starts_with_one_name_the_refused_one_takes_nothing_from_the_other(upstream_src, demo_shards, model,
                                                                                  tmp_path):
    """The refused start listed --logs before the other made the run folder: that proves nothing is its own.

    The refused start waits, its --logs listed, until the other has opened out.log; the other waits in its data
    set-up (its run folder made) until the refused one has ended, then trains."""
    def start(**wait):
        return subprocess.Popen([sys.executable, JOBS / "failing_start.py", *_args(demo_shards, model)], cwd=tmp_path,
                                env=upstream_env(upstream_src, **DETERMINISTIC, **wait), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    def waiting(proc, where):
        for _ in range(TIMEOUT * 10):
            if (tmp_path / f"waiting-in-{where}").exists() or proc.poll() is not None:
                break
            time.sleep(0.1)
        return (tmp_path / f"waiting-in-{where}").exists()

    procs = [start(WAIT_IN="init_distributed_device", WAIT_FOR="logs/run/out.log")]
    try:
        assert waiting(procs[0], "init_distributed_device") and not (tmp_path / "logs").exists()
        procs.append(start(WAIT_IN="get_data", WAIT_FOR="refused-ended"))
        assert waiting(procs[1], "get_data")
        refused = subprocess.CompletedProcess(procs[0].args, procs[0].wait(TIMEOUT), *procs[0].communicate())
        (tmp_path / "refused-ended").touch()
        trains = subprocess.CompletedProcess(procs[1].args, procs[1].wait(TIMEOUT), *procs[1].communicate())
    finally:
        for proc in procs:
            proc.kill()
    assert refused.returncode == 1 and "Experiment already exists" in refused.stdout, tail(refused)
    assert "error:" not in refused.stderr, tail(refused)
    assert trains.returncode == 0, tail(trains)
    assert (tmp_path / "logs" / "run" / "checkpoints" / "epoch_1.pt").is_file()


@pytest.mark.parametrize("more", [[], ["--accum-freq", "1", "--precision", "fp32"]],
                         ids=["fixed-step", "upstreams-one-batch-step"])
def test_a_failure_after_the_first_step_keeps_everything_as_upstream_leaves_it(upstream_src, demo_shards, model,
                                                                               tmp_path, more):
    proc = _start(upstream_src, _args(demo_shards, model, *more), tmp_path, fail_at="after_epoch")
    assert proc.returncode == 1 and "RuntimeError: injected: failed after an epoch" in proc.stderr, tail(proc)
    assert "Traceback" in proc.stderr and ERROR not in proc.stderr
    assert "Train Epoch: 0 [8/8 (100%)]" in (tmp_path / "logs" / "run" / "out.log").read_text()


@pytest.mark.skipif(sys.platform == "darwin", reason="gloo on Linux CI")
def test_two_ranks_each_say_their_line_and_the_rank_that_made_the_folder_removes_it(upstream_src, demo_shards, model,
                                                                                   tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, JOBS / "failing_start.py", *_args(demo_shards, model)], cwd=tmp_path,
                              env=upstream_env(upstream_src, **DETERMINISTIC, RANK=str(rank), LOCAL_RANK=str(rank),
                                               WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    try:
        done = [subprocess.CompletedProcess(p.args, *((p.wait(timeout=TIMEOUT),) + p.communicate()))
                for p in procs]
    finally:
        for p in procs:
            p.kill()
    ddp = "ValueError: DistributedDataParallel device_ids and output_device arguments only work with"
    _one_line(done[0], f"{ERROR} on rank 0: {ddp}", REMOVED.format("logs/run"))
    assert "run folder" not in _one_line(done[1], f"{ERROR} on rank 1: {ddp}")
    assert not (tmp_path / "logs").exists()
