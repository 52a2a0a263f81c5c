"""Elastic resume, for real: torchrun (gloo, CPU) at world size 2, stopped inside an epoch, resumed at 1 and 3.

The samples each run trained on are recorded by key (tests/loader_jobs/elastic_trainer.py), with the
learning rate of every step. An epoch of 384 samples is 6 steps at world size 2 (2 microbatches of
16 per rank); the stop comes after step 3, so the rest is 6 steps at world size 1 and 2 at 3.
"""
import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from longrun_common import SUBPROCESS_ENV, dropout_model, run_argv

JOB = Path(__file__).resolve().parent / "loader_jobs" / "elastic_trainer.py"
PER_STEP = 64  # samples of one optimizer step at world size 2: the schedule's own step


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from types import SimpleNamespace

    from naflex_accum.data import write_demo_data

    folder = tmp_path_factory.mktemp("elastic")
    # 30 shards of 16, 5 per slot a pass: an epoch takes 64 samples a slot, so no sample comes twice
    data = write_demo_data(str(folder / "data"), num_samples=480, val_samples=16, shard_size=16, processes=1)
    shards = SimpleNamespace(train=data.train, val=data.val)
    return folder, shards, dropout_model(folder)


def torchrun(folder, shards, model, name, world, *extra, workers=1, record=None, **env):
    slots = [] if env.get("NO_SLOTS_FLAG") else ["--data-slots", "6"]  # a resume keeps the saved slots anyway
    argv = run_argv(shards, model, folder / "logs", name, *slots, "--check-every-n-steps", "1",
                    *extra, samples=384, epochs=2, workers=workers)
    argv = [a for a in argv if a not in ("--logs-dir", str(folder / "logs"))]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), str(JOB),
           "--logs-dir", str(folder / "logs"), *argv]
    env = {**SUBPROCESS_ENV, "RECORD": str(folder / (record or name)), "SHUFFLE_BUFFER": "8", **env}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    runs = [json.loads((folder / f"{record or name}-rank{r}.json").read_text()) for r in range(world)]
    return proc, runs


def batches(runs, epoch):
    return [key for records in runs for kind, e, _, keys in (r for r in records if r[0] == "batch")
            if e == epoch for key in keys]


def lrs(runs):
    """Rank 0's (position, lr) per step: the rate is set before each microbatch, the same within a step."""
    out = []
    for kind, position, lr in (r for r in runs[0] if r[0] == "lr"):
        if not out or out[-1][0] != position:
            out.append((position, lr))
    return out


@pytest.fixture(scope="module")
def runs(setup):
    folder, shards, model = setup
    whole, whole_runs = torchrun(folder, shards, model, "whole", 2)
    assert whole.returncode == 0, whole.stderr[-3000:]
    cut, cut_runs = torchrun(folder, shards, model, "cut", 2, STOP_AT="0:5",
                             STOP_FILE=str(folder / "logs/cut/STOP"))
    assert "exitcode  : 75" in cut.stderr, cut.stderr[-3000:]  # every rank stopped on request (torchrun says 1)
    resumed = {}
    for world, workers in ((1, 2), (3, 0)):
        name = f"w{world}"
        shutil.copytree(folder / "logs/cut", folder / "logs" / name)
        proc, ranks = torchrun(folder, shards, model, name, world, "--resume", "latest", workers=workers)
        assert proc.returncode == 0, proc.stderr[-3000:]
        resumed[world] = ranks, (folder / "logs" / name / "out.log").read_text()
    return whole_runs, cut_runs, resumed


def test_the_stop_saved_inside_the_epoch(setup, runs):
    folder = setup[0]
    saved = torch.load(folder / "logs/cut/checkpoints/epoch_latest.pt", weights_only=True)
    assert (saved["epoch"], saved["step_in_epoch"], saved["epoch_samples"]) == (0, 3, 3 * PER_STEP)
    assert saved["segment"]["world_size"] == 2 and saved["segment"]["slots"] == 6


@pytest.mark.parametrize("world", [1, 3])
def test_every_epoch_trains_on_the_uninterrupted_samples_once(runs, world):
    whole, cut, resumed = runs
    ranks, log = resumed[world]
    for epoch in (0, 1):
        reference = batches(whole, epoch)
        seen = (batches(cut, 0) if epoch == 0 else []) + batches(ranks, epoch)
        assert len(reference) == len(set(reference)) == 384
        duplicates = [key for key, n in Counter(seen).items() if n > 1]
        assert not duplicates, duplicates[:3]
        assert sorted(seen) == sorted(reference)
    assert f"Epoch 0 goes on at world size {world} (saved at 2) from global sample {3 * PER_STEP}" in log


@pytest.mark.parametrize("world", [1, 3])
def test_the_learning_rate_is_continuous_in_samples_seen(runs, world):
    whole, cut, resumed = runs
    reference = lrs(whole)
    assert [p for p, _ in reference] == list(range(12))  # the schedule's steps: 6 per epoch at world size 2
    before = lrs(cut)
    assert before == reference[:3]  # steps 1-3; the stop comes before step 4
    after = lrs(resumed[world][0])
    per_step = PER_STEP * world / 2  # samples of one step at this world size
    steps_left, steps_next = int(3 * PER_STEP / per_step), int(6 * PER_STEP / per_step)
    # each step's position is the samples seen before it, in the schedule's steps: linear in samples
    expected = [3 + j * per_step / PER_STEP for j in range(steps_left)] + \
               [6 + j * per_step / PER_STEP for j in range(steps_next)]
    assert [p for p, _ in after] == pytest.approx(expected)
    assert after[0][1] == pytest.approx(reference[3][1])  # the first rate after the resume: where it stopped
    rates = [lr for _, lr in after]
    assert all(a >= b for a, b in zip(rates, rates[1:]))  # past the warmup, cosine only falls


def test_a_world_size_the_saved_slots_do_not_divide_is_one_line(setup, runs):
    folder, shards, model = setup
    shutil.copytree(folder / "logs/cut", folder / "logs/w4")
    proc, _ = torchrun(folder, shards, model, "w4", 4, "--resume", "latest", workers=0, record="w4",
                       NO_SLOTS_FLAG="1")
    # torchrun reports a failed child with a traceback of its own; none goes through the trainer's code
    lines = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert "naflex_accum" not in proc.stderr and "exitcode  : 2" in proc.stderr, proc.stderr[-3000:]
    assert len(lines) == 1 and "saved at world size 2 with --data-slots 6 is not a multiple of the world " \
        "size 4" in lines[0] and "e.g. 12" in lines[0], lines
    assert not (folder / "logs/w4/checkpoints/epoch_1.pt").exists()
