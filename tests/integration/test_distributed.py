"""Multi-process: world set-up from torchrun/SLURM variables, and 2-process gloo runs on the CPU.

Every subprocess has a timeout, so a hung collective fails the test instead of CI.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parents[1]

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def run_2proc(args, timeout=600, env_extra=None, **kw):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(env_extra or {}),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS.parent), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([*TORCHRUN, *args], capture_output=True, text=True, timeout=timeout, env=env, **kw)


def dist_rows(*args):
    proc = run_2proc([str(TESTS / "dist_equivalence.py"), *args])
    return proc, [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def checks():
    """Ours, upstream's bugs, a missing no_sync and ours under a bf16 FSDP2 policy, in one torchrun start (last
    the one that a regression crashes): ``checks(check)`` gives its rows."""
    proc, rows = dist_rows("--wrap", "ddp", "fsdp2", "--then", "--bug", "upstream-style",
                           "--then", "--wrap", "ddp", "fsdp2", "--bug", "always-sync", "--find-unused-parameters",
                           "--quick", "--then", "--wrap", "fsdp2-bf16")
    tail = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode in (0, 1), tail  # 1: some case failed (a bug's)
    by_check = {check: [r for r in rows if r["job"] == job] for job, check in enumerate(("ours", "upstream-style",
                                                                                           "always-sync", "bf16"))}

    def rows_of(check):
        """A check's rows; none (a rank crashed before them) fails with the start's output."""
        assert by_check[check], f"no rows for {check}: the torchrun start ended before them\n{tail}"
        return by_check[check]
    return rows_of


def test_two_process_accumulation_equals_full_batch(checks):
    """DDP (CLIP, SigLIP, CoCa) and real FSDP2, both modes: exact, and one gradient reduction per window."""
    rows = checks("ours")
    ddp = [r for r in rows if r["wrap"] == "ddp"]
    fsdp = [r for r in rows if r["wrap"] == "fsdp2"]
    assert len(ddp) == 2 * 2 * 6 and len(fsdp) == 2 * 2 * 2 and all(r["passed"] for r in rows)
    assert {r["loss"] for r in ddp} == {"clip", "siglip", "coca"} and {r["mode"] for r in rows} == {
        "replay", "cached-loss"}
    assert all(r["reduction_rounds"] == 1 for r in ddp)  # one all-reduce round per window (a comm hook counts)
    assert all(r["reduction_rounds"] == r["reference_rounds"] > 0 for r in fsdp)  # reduce-scatters of 1 backward
    worst = max(r["tower_rel_err"] for r in rows)
    print(f"2 ranks, {len(rows)} rank-cases: largest tower rel err {worst:.2e}; logit ratios "
          f"{sorted({round(v, 6) for r in rows for v in r['logit_ratios'].values()})}")
    assert worst <= 1e-5


def test_two_process_fsdp2_bf16_policy_equals_full_batch(checks):
    """Upstream's ``--fsdp --precision amp_bf16`` sharding (bf16 parameters, fp32 reduction), both modes: the
    window trains (one dtype per reduce-scatter) and matches one full-batch backward to bf16 round-off."""
    rows = checks("bf16")
    assert len(rows) == 2 * 2 * 2 and all(r["passed"] for r in rows)
    assert all(r["reduction_rounds"] == r["reference_rounds"] > 0 for r in rows)
    assert all(set(r["logit_ratios"]) == ({"logit_scale", "logit_bias"} if r["loss"] == "siglip" else
                                          {"logit_scale"}) for r in rows)


def test_two_process_check_catches_upstream_bugs(checks):
    rows = checks("upstream-style")
    assert not any(r["passed"] for r in rows)
    assert {r["mode"] for r in rows} == {"replay", "cached-loss"}


def test_two_process_check_catches_a_missing_no_sync(checks):
    """Gradient sync left on in every backward: gradients still exact, only the reduction count shows it."""
    rows = checks("always-sync")
    assert not any(r["passed"] for r in rows)
    assert all(r["tower_rel_err"] <= 1e-5 for r in rows)
    assert all(r["reduction_rounds"] == len(r["split"]) * r["reference_rounds"] for r in rows)
    assert {(r["wrap"], r["mode"]) for r in rows} == {(w, m) for w in ("ddp", "fsdp2") for m in ("replay",
                                                                                               "cached-loss")}


def test_two_process_training_run(tmp_path):
    from naflex_accum.data import write_demo_data

    shards = write_demo_data(tmp_path / "data", num_samples=96, val_samples=16, seed=0)
    proc = run_2proc(["-m", "naflex_accum.train", "--train-data", shards.train, "--val-data", shards.val,
                      "--naflex-seq-lens", "16", "--naflex-max-tokens-per-batch", "128", "--naflex-batch-divisor",
                      "1", "--train-num-samples", "64", "--epochs", "1", "--workers", "0", "--device", "cpu",
                      "--accum-freq", "2", "--naflex-loss-scale", "linear", "--batch-size", "8",
                      "--logs-dir", str(tmp_path / "logs"), "--name", "ddp", "--report-to", "tensorboard",
                      "--log-every-n-steps", "1", "--val-seq-len", "16"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = list((tmp_path / "logs").iterdir())
    assert [r.name for r in runs] == ["ddp"]
    assert sorted(p.name for p in (runs[0] / "checkpoints").iterdir()) == ["epoch_1.pt", "results.jsonl"]
    ckpt = torch.load(runs[0] / "checkpoints" / "epoch_1.pt", weights_only=False)
    assert ckpt["samples_seen"] == 64 and not any(k.startswith("module.") for k in ckpt["state_dict"])
    log = (runs[0] / "out.log").read_text()
    assert "world size 2" in log and log.count("Run folder") == 1  # rank 0 writes, once
    assert proc.stdout.count("Run folder:") == 1


def test_every_rank_cuts_its_epochs_from_rank_0s_shard_sizes(tmp_path):
    """A source each rank would count differently (here a pipe: that gives rank 1 half the shard; in life a flaky
    mount or a shard still being copied): the ranks take rank 0's sizes, so they run the same steps and the job
    ends, instead of two schedules waiting on each other."""
    from naflex_accum.data import write_demo_data

    shards = write_demo_data(tmp_path / "data", num_samples=96, val_samples=0, seed=0)
    shard = shards.train.replace("{000000..000000}", "000000")
    half = os.path.getsize(shard) // 2
    source = f"pipe:if [ \"$RANK\" = 1 ]; then head -c {half} {shard}; else cat {shard}; fi"
    env = {"NAFLEX_ACCUM_CACHE": str(tmp_path / "cache")}
    proc = run_2proc(["-m", "naflex_accum.train", "--train-data", source, "--naflex-seq-lens", "16",
                      "--naflex-max-tokens-per-batch", "128", "--naflex-batch-divisor", "1", "--epochs", "1",
                      "--workers", "0", "--device", "cpu", "--accum-freq", "2", "--logs-dir", str(tmp_path / "logs"),
                      "--name", "sizes"], timeout=240, env_extra=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = (tmp_path / "logs/sizes/out.log").read_text()
    assert "96 samples in 1 shard(s)" in log
