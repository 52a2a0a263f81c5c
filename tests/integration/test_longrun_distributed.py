"""Two processes (torchrun, gloo, CPU): the loop's collectives per optimizer step, and a stop request that
reaches one rank only. (Resuming is the same code per rank as in one process: test_longrun.py.)"""
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import torch
from longrun_common import SUBPROCESS_ENV, reference, run_argv

TESTS = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
LOOP_MODULES = ("naflex_accum.train.loop", "naflex_accum.train.monitor", "naflex_accum.train.ending.preempt")


def run_ranks(argv, events_dir: Path, **env):
    events_dir.mkdir(exist_ok=True)
    proc = subprocess.run([*TORCHRUN, str(TESTS / "longrun_dist_driver.py"), *argv], capture_output=True, text=True,
                          timeout=300, env={**SUBPROCESS_ENV, "EVENTS_DIR": str(events_dir), **env})
    ranks = [json.loads((events_dir / f"rank{r}.json").read_text()) if (events_dir / f"rank{r}.json").exists()
             else None for r in (0, 1)]
    assert all(ranks), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, ranks


def test_one_packed_check_per_step_at_most_and_every_rank_stops_at_the_same_step(tmp_path, tmp_path_factory):
    shards, model, _ = reference(tmp_path_factory)
    # 256 samples over 2 ranks: 4 steps of 2 microbatches per epoch; checks at steps 1 (log), 3 (every 3),
    # 4 (last of epoch 0), 5 (log), 6 (every 3), 8 (last of epoch 1), never at 2 or 7.
    argv = run_argv(shards, model, tmp_path / "logs", "ddp", "--check-every-n-steps", "3", "--log-every-n-steps",
                    "100", samples=256, workers=0)
    # SIGUSR1 reaches rank 1 alone, in step 7: honoured at the next check, step 8, the last of epoch 1
    proc, ranks = run_ranks(argv, tmp_path / "ev1", STOP_RANK="1", STOP_MICROBATCH="13")
    assert [r["exit_code"] for r in ranks] == [75, 75], proc.stderr[-3000:]
    for r in ranks:
        per_step = Counter(step for step, _, module in r["events"] if module in LOOP_MODULES)
        print(sorted(per_step.items()))
        checks = sorted(step for step, op, module in r["events"] if module == "naflex_accum.train.monitor")
        assert checks == [1, 3, 4, 5, 6, 8]
        assert per_step[0] == 1  # the first window's sizes agree across ranks (once per run)
        assert all(n <= 1 for step, n in per_step.items() if step > 0)
    mid = torch.load(tmp_path / "logs/ddp/checkpoints/epoch_latest.pt", weights_only=True)
    assert (mid["epoch"], mid["step_in_epoch"], mid["global_step"], len(mid["rng_states"])) == (1, 4, 8, 2)
    log = (tmp_path / "logs/ddp/out.log").read_text()
    assert "Stopped on request (another rank's request) after step 4 of epoch 1" in log


def test_siglip_trains_under_the_trainers_ddp(tmp_path, tmp_path_factory):
    """SigLIP's loss through the trainer's own DDP wrapping (``find_unused_parameters=True`` there fails it:
    'Expected to mark a variable ready only once')."""
    shards, model, _ = reference(tmp_path_factory)
    argv = run_argv(shards, model, None, None, "--siglip", epochs=1, samples=64, workers=0)
    proc = subprocess.run([*TORCHRUN, "-m", "naflex_accum.train", "--logs-dir", str(tmp_path / "logs"), "--name",
                           "siglip", *argv], capture_output=True, text=True, timeout=300, env=SUBPROCESS_ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "logs/siglip/checkpoints/epoch_1.pt").exists()
