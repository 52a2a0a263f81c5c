"""``--fsdp`` in the built-in trainer, for real: torchrun (2 processes, gloo, CPU) against a DDP run.

The model has patch dropout (longrun_common), so a replay that drew other masks would show.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from longrun_common import SUBPROCESS_ENV, dropout_model, make_shards, run_argv, weights

JOB = Path(__file__).resolve().parents[1] / "loader_jobs" / "counting_trainer.py"
TOL = 2e-5  # round-off: FSDP reduce-scatters where DDP all-reduces, in another order


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fsdp")
    return folder, make_shards(folder), dropout_model(folder)


def torchrun(folder, shards, model, name, *extra, world=2, epochs=2, check=True):
    argv = run_argv(shards, model, None, name, *extra, epochs=epochs, workers=0)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), str(JOB),
           "--logs-dir", str(folder / "logs"), "--name", name, *argv]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**SUBPROCESS_ENV, "RECORD": str(folder / name)})
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    counts = [json.loads((folder / f"{name}-rank{r}.json").read_text()) for r in range(world)]
    return proc, counts


def max_diff(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].shape == b[k].shape, k
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.fixture(scope="module")
def runs(setup):
    """The DDP run, and the FSDP run with --grad-checkpointing and evaluation (neither changes the weights),
    both saving step 3 for the tests that resume from it (each torchrun start costs seconds)."""
    folder, shards, model = setup
    _, ddp = torchrun(folder, shards, model, "ddp", "--save-every-n-steps", "3")
    _, sharded = torchrun(folder, shards, model, "fsdp", "--fsdp", "--grad-checkpointing", "--val-data", shards.val,
                          "--save-every-n-steps", "3")
    return ddp, sharded


def test_fsdp_with_grad_checkpointing_ends_with_the_ddp_runs_weights(setup, runs):
    """Without --grad-checkpointing: the stopped and resumed runs below end with the same weights."""
    folder = setup[0]
    a, b = weights(folder / "logs/ddp/checkpoints/epoch_2.pt"), weights(folder / "logs/fsdp/checkpoints/epoch_2.pt")
    assert b["logit_scale"].shape == torch.Size([])  # the plain model's form, as a DDP run writes it
    assert max_diff(a, b) < TOL
    assert max_diff(a, weights(folder / "logs/ddp/checkpoints/epoch_1.pt")) > 1e-3  # it did train


def test_one_reduce_scatter_round_per_window(runs):
    _, sharded = runs
    for counts in sharded:  # 2 epochs of 2 optimizer steps, 2 microbatches each: only the last backward syncs
        assert counts["steps"] == 4 and counts["units"] > 2
        assert counts["reduce_scatters"] == counts["steps"] * counts["units"]


def test_fsdp_checkpoints_load_without_fsdp(setup, runs):
    from naflex_accum.models import create_model

    folder, _, model_json = setup
    plain = create_model(model_json)
    plain.load_state_dict(weights(folder / "logs/fsdp/checkpoints/epoch_2.pt"))  # strict: every key, every shape
    saved = torch.load(folder / "logs/fsdp/checkpoints/epoch_2.pt", weights_only=True)
    assert all(isinstance(name, str) for name in saved["optimizer"]["state"])  # by parameter name


@pytest.mark.parametrize("first,then", [("fsdp", None), ("ddp", "--fsdp")])
def test_a_run_stopped_with_or_without_fsdp_resumes_with_the_other(setup, runs, first, then):
    """Resumed from the other strategy's step 3 (step 1 of epoch 1: optimizer state and all), in a new folder."""
    folder, shards, model = setup
    name = f"from-{first}"
    _, counts = torchrun(folder, shards, model, name, *([then] if then else []), "--resume",
                         str(folder / "logs" / first / "checkpoints/step_3.pt"))
    assert counts[0]["steps"] == 1
    reference = weights(folder / "logs/ddp/checkpoints/epoch_2.pt")
    assert max_diff(weights(folder / "logs" / name / "checkpoints/epoch_2.pt"), reference) < TOL


def test_fsdp_evaluates_on_rank_0_with_the_whole_model(setup, runs):
    log = (setup[0] / "logs/fsdp/out.log").read_text()
    assert "Eval Epoch: 1" in log and "Eval Epoch: 2" in log and "image_to_text_R@1" in log


def test_fsdp_evaluates_a_run_of_several_patch_sizes(setup):
    """The whole copy rank 0 evaluates is built for the run's sizes: it takes the unflattened size-8 batches."""
    folder, shards, model = setup
    torchrun(folder, shards, model, "fsdp-ps", "--fsdp", "--val-data", shards.val, "--naflex-patch-sizes", "8", "16",
             epochs=1)
    log = (folder / "logs/fsdp-ps/out.log").read_text()
    assert "Eval Epoch: 1" in log and "image_to_text_R@1" in log


def test_fsdp_flags_that_do_not_apply_are_one_line(capsys):
    from naflex_accum.cli import main

    base = ["--train-data", "x.tar", "--device", "cpu"]
    for flags, needle in ((["--fsdp-offload-cpu"], "CPU offload is untested"),
                          (["--fsdp-checkpoint", "sharded"], "valid values here: 'full'")):
        assert main(["train", *base, "--fsdp", *flags]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and needle in err, err


def test_the_nonfinite_guard_under_fsdp(setup):
    folder, shards, model = setup
    proc, counts = torchrun(folder, shards, model, "fsdp-nan", "--fsdp", "--lr", "1e8", "--warmup", "0",
                            "--save-every-n-steps", "1", "--check-every-n-steps", "1", epochs=4, check=False)
    assert "exitcode  : 3" in proc.stderr and "Non-finite loss" in proc.stdout, proc.stdout[-2000:]
    for path in sorted((folder / "logs/fsdp-nan/checkpoints").iterdir()):  # every shard was checked first
        state = weights(path)
        assert all(torch.isfinite(t).all() for t in state.values() if t.is_floating_point()), path


def test_a_stop_request_under_fsdp_saves_and_resumes_to_the_uninterrupted_weights(setup, runs):
    folder, shards, model = setup
    job = Path(__file__).resolve().parents[1] / "loader_jobs" / "elastic_trainer.py"
    root = folder / "logs" / "fsdp-stop"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(job),
           "--logs-dir", str(folder / "logs"), *run_argv(shards, model, None, "fsdp-stop", "--fsdp", epochs=2,
                                                         workers=0), "--name", "fsdp-stop"]
    env = {**SUBPROCESS_ENV, "RECORD": str(folder / "fsdp-stop"), "STOP_AT": "0:1", "STOP_FILE": str(root / "STOP")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert "exitcode  : 75" in proc.stderr, proc.stderr[-3000:]  # every rank saved and stopped after step 1
    saved = torch.load(root / "checkpoints/epoch_latest.pt", weights_only=True)
    assert (saved["epoch"], saved["step_in_epoch"]) == (0, 1) and saved["state_dict"]["logit_scale"].dim() == 0
    torchrun(folder, shards, model, "fsdp-stop", "--fsdp", "--resume", "latest")
    reference = weights(folder / "logs/ddp/checkpoints/epoch_2.pt")
    assert max_diff(weights(root / "checkpoints/epoch_2.pt"), reference) < TOL


def test_pretrained_from_an_fsdp_checkpoint(setup, runs, tmp_path):
    from longrun_common import train_in_process

    folder, shards, model = setup
    result = train_in_process(run_argv(shards, model, tmp_path, "ft", "--pretrained",
                                       str(folder / "logs/fsdp/checkpoints/epoch_2.pt"), epochs=1, workers=0))
    assert result["exit_code"] == 0 and result["global_step"] == 4
