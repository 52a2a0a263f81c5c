"""Elastic resume, for real: torchrun (gloo, CPU) at world size 2, stopped inside an epoch, resumed at 1, stopped
again, resumed at 3; the trainer's own shuffle (--sample-shuffle-size 1000, more than a slot's part).

The samples each run trained on are recorded by key (tests/loader_jobs/elastic_trainer.py), with the
learning rate of every step. An epoch of 384 samples is 6 steps at world size 2 (2 microbatches of
16 per rank); the first stop comes after step 3 (192 samples), the second after 3 more steps at world
size 1 (32 samples each: 288), and world size 3 ends the epoch with one step of 96, then 4 in the next.
"""
import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from longrun_common import SUBPROCESS_ENV, dropout_model, run_argv

JOB = Path(__file__).resolve().parents[1] / "loader_jobs" / "elastic_trainer.py"
PER_STEP = 64  # samples of one optimizer step at world size 2: the schedule's own step


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from naflex_accum.data import write_demo_data

    folder = tmp_path_factory.mktemp("elastic")
    # 30 shards of 16: an epoch of 384 of the 480 samples
    data = write_demo_data(str(folder / "data"), num_samples=480, val_samples=16, shard_size=16, processes=1)
    shards = SimpleNamespace(train=data.train, val=data.val)
    return folder, shards, dropout_model(folder)


def torchrun(folder, shards, model, name, world, *extra, workers=1, record=None, **env):
    argv = run_argv(shards, model, folder / "logs", name, "--data-slots", "6", "--check-every-n-steps", "1",
                    *extra, samples=384, epochs=2, workers=workers)
    argv = [a for a in argv if a not in ("--logs-dir", str(folder / "logs"))]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), str(JOB),
           "--logs-dir", str(folder / "logs"), *argv]
    env = {**SUBPROCESS_ENV, "RECORD": str(folder / (record or name)), **env}
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
    shutil.copytree(folder / "logs/cut", folder / "logs/chain")
    one, one_runs = torchrun(folder, shards, model, "chain", 1, "--resume", "latest", workers=2, record="one",
                             STOP_AT="0:5", STOP_FILE=str(folder / "logs/chain/STOP"))
    assert "exitcode  : 75" in one.stderr, one.stderr[-3000:]
    three, three_runs = torchrun(folder, shards, model, "chain", 3, "--resume", "latest", workers=0,
                                 record="three")
    assert three.returncode == 0, three.stderr[-3000:]
    log = (folder / "logs/chain/out.log").read_text()
    return whole_runs, cut_runs, one_runs, three_runs, log


def test_the_stop_saved_inside_the_epoch(setup, runs):
    folder = setup[0]
    saved = torch.load(folder / "logs/cut/checkpoints/epoch_latest.pt", weights_only=True)
    assert (saved["epoch"], saved["step_in_epoch"], saved["epoch_samples"]) == (0, 3, 3 * PER_STEP)
    assert saved["segment"]["world_size"] == 2 and saved["segment"]["slots"] == 6


def test_every_epoch_trains_on_the_uninterrupted_samples_once(runs):
    whole, cut, one, three, log = runs
    for epoch in (0, 1):
        reference = batches(whole, epoch)
        seen = (batches(cut, 0) + batches(one, 0) if epoch == 0 else []) + batches(three, epoch)
        assert len(reference) == len(set(reference)) == 384
        duplicates = [key for key, n in Counter(seen).items() if n > 1]
        assert not duplicates, duplicates[:3]
        assert sorted(seen) == sorted(reference)
    assert f"Epoch 0 goes on at world size 1 (saved at 2) from global sample {3 * PER_STEP}" in log
    assert "Epoch 0 goes on at world size 3 (saved at 1) from global sample 288" in log


def test_the_learning_rate_is_continuous_in_samples_seen(runs):
    whole, cut, one, three, _ = runs
    reference = lrs(whole)
    assert [p for p, _ in reference] == list(range(12))  # the schedule's steps: 6 per epoch at world size 2
    assert lrs(cut) == reference[:3]  # steps 1-3; the stop comes before step 4
    # each step's position is the samples seen before it, in the schedule's steps (64 samples): linear in samples
    assert [p for p, _ in lrs(one)] == pytest.approx([3, 3.5, 4])
    assert [p for p, _ in lrs(three)] == pytest.approx([4.5, 6, 7.5, 9, 10.5])
    assert lrs(one)[0][1] == pytest.approx(reference[3][1])  # the first rate after the resume: where it stopped
    rates = [lr for _, lr in lrs(one) + lrs(three)]
    assert all(a >= b for a, b in zip(rates, rates[1:]))  # past the warmup, cosine only falls
    assert max(lr for runs in (whole, cut, one, three) for _, lr in lrs(runs)) <= 1e-3  # never above --lr


def test_a_world_size_the_saved_slots_do_not_divide_is_one_line(setup, runs):
    """The check each rank of a resume at world size 4 makes on the 2-rank run's checkpoint from inside epoch 0
    (--data-slots 6), before anything is restored. Its one line under torchrun, as any error every rank meets:
    test_rank_failures.py's bad flag."""
    from naflex_accum.errors import UsageError
    from naflex_accum.train.kept.resume import _saved_segment

    path = setup[0] / "logs/cut/checkpoints/epoch_latest.pt"
    payload = torch.load(path, map_location="cpu", weights_only=True)
    world = SimpleNamespace(world_size=4, rank=0)
    with pytest.raises(UsageError) as refused:
        _saved_segment(payload, str(path), SimpleNamespace(), world)
    assert "saved at world size 2 with --data-slots 6 is not a multiple of the world size 4" in str(refused.value)
    assert "e.g. 12" in str(refused.value) and "\n" not in str(refused.value)
    for size in (1, 3):  # the sizes the chain above resumed at
        _saved_segment(payload, str(path), SimpleNamespace(), SimpleNamespace(world_size=size, rank=0))