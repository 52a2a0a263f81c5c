"""Long runs, in one process: stop requests by real signals at any step, step checkpoints and retention,
--resume latest, the non-finite guard, and safe checkpoint reading. Subprocess faults: test_longrun_faults.py."""

import signal

import pytest
import torch
from longrun_common import assert_identical, reference, run_argv, signal_at, train_in_process, weights
from unit.train.test_checkpoint import flip_values

from naflex_accum.cli import main as cli_main
from naflex_accum.train.checkpoint import newest_loadable
from naflex_accum.train.preempt import EXIT_STOPPED


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Shards, the dropout model and the uninterrupted run's final weights (2 epochs x 4 steps)."""
    return reference(tmp_path_factory)


def ckpt_names(root):
    return sorted(p.name for p in (root / "checkpoints").iterdir())


@pytest.mark.parametrize("signum,microbatch,where", [
    (signal.SIGUSR1, 12, (1, 2)),  # epoch 1 (0-based), inside: after its step 2 of 4
    (signal.SIGTERM, 8, (0, 4)),   # the last step of epoch 0
])
def test_signal_stops_after_the_step_and_resume_is_exact(setup, tmp_path, monkeypatch, signum, microbatch, where):
    shards, model, whole = setup
    signal_at(monkeypatch, signum, microbatch)
    first = train_in_process(run_argv(shards, model, tmp_path, "cut", "--check-every-n-steps", "100",
                                      "--log-every-n-steps", "100"))
    monkeypatch.undo()
    root = tmp_path / "cut"
    assert first["exit_code"] == EXIT_STOPPED and first["preempted"]
    mid = torch.load(root / "checkpoints/epoch_latest.pt", weights_only=True)
    assert (mid["epoch"], mid["step_in_epoch"]) == where and mid["schedule"]["accum_freq"] == 2
    assert f"Stopped on request ({signal.Signals(signum).name})" in (root / "out.log").read_text()
    second = train_in_process(run_argv(shards, model, tmp_path, "cut", "--resume", "latest"))
    assert second["exit_code"] == 0 and second["epoch"] == 2
    assert "epoch_latest.pt" not in ckpt_names(root)  # superseded by epoch_2.pt
    assert_identical(weights(root / "checkpoints/epoch_2.pt"), whole)


def test_one_step_epochs_stop(setup, tmp_path, monkeypatch):
    """Every step is the last of its epoch: a stop request is still honoured, and the resume is exact."""
    shards, model, _ = setup
    args = ("--epochs", "3", "--train-num-samples", "32")
    train_in_process(run_argv(shards, model, tmp_path, "whole1", *args))
    signal_at(monkeypatch, signal.SIGTERM, 3)  # epoch 1's only step
    first = train_in_process(run_argv(shards, model, tmp_path, "cut1", *args))
    monkeypatch.undo()
    assert first["exit_code"] == EXIT_STOPPED and first["global_step"] == 2
    train_in_process(run_argv(shards, model, tmp_path, "cut1", *args, "--resume", "latest"))
    assert_identical(weights(tmp_path / "cut1/checkpoints/epoch_3.pt"),
                     weights(tmp_path / "whole1/checkpoints/epoch_3.pt"))


def test_step_checkpoints_retention_and_exact_resume(setup, tmp_path):
    shards, model, whole = setup
    extra = ("--save-every-n-steps", "3", "--keep-last", "1", "--save-most-recent", "--delete-previous-checkpoint")
    train_in_process(run_argv(shards, model, tmp_path, "steps", *extra))
    root = tmp_path / "steps"
    # step_3 pruned when step_6 was written; epoch_1.pt deleted once epoch_2.pt was
    assert ckpt_names(root) == ["epoch_2.pt", "epoch_latest.pt", "step_6.pt"]
    step6 = torch.load(root / "checkpoints/step_6.pt", weights_only=True)
    assert (step6["epoch"], step6["step_in_epoch"], step6["global_step"]) == (1, 2, 6)
    assert len(step6["rng_states"]) == 1 and step6["segment"]["world_size"] == 1
    assert torch.load(root / "checkpoints/epoch_latest.pt", weights_only=True)["epoch"] == 2
    assert_identical(weights(root / "checkpoints/epoch_2.pt"), whole)
    # as if killed after step 6: resume latest from it ends where the uninterrupted run did
    for name in ("epoch_2.pt", "epoch_latest.pt"):
        (root / "checkpoints" / name).unlink()
    result = train_in_process(run_argv(shards, model, tmp_path, "steps", *extra, "--resume", "latest"))
    assert result["global_step"] == 8 and result["exit_code"] == 0
    assert ckpt_names(root) == ["epoch_2.pt", "epoch_latest.pt", "step_6.pt"]
    assert_identical(weights(root / "checkpoints/epoch_2.pt"), whole)


def test_resume_latest_skips_damaged_files_and_removes_stale_temps(setup, tmp_path, capsys):
    from naflex_accum.train.logs import setup_logging

    shards, model, _ = setup
    train_in_process(run_argv(shards, model, tmp_path, "dmg", "--save-every-n-steps", "2", "--keep-last", "3",
                              epochs=1))
    ckpts = tmp_path / "dmg/checkpoints"
    newest = ckpts / "epoch_1.pt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # truncated
    (ckpts / "step_4.pt").write_bytes(b"not a checkpoint")
    (ckpts / ".step_6.pt.tmp-12345").write_bytes(b"left by a killed save")
    setup_logging(None)
    path, payload = newest_loadable(ckpts)
    assert path.name == "step_2.pt" and payload["global_step"] == 2
    out = capsys.readouterr().out
    assert "skipping --resume" in out and "epoch_1.pt" in out and "step_4.pt" in out
    result = train_in_process(run_argv(shards, model, tmp_path, "dmg", "--resume", "latest", epochs=1))
    assert result["exit_code"] == 0 and result["global_step"] == 4
    assert not (ckpts / ".step_6.pt.tmp-12345").exists()
    assert "Removed" in capsys.readouterr().out


@pytest.mark.parametrize("saves", [("--save-every-n-steps", "1"), ("--save-frequency", "0")])
def test_nonfinite_loss_stops_without_saving_nan(setup, tmp_path, capsys, saves):
    """--lr 1e8 diverges within a few steps; the loss check stops the run even where no save would."""
    shards, model, _ = setup
    code = cli_main(["train", *run_argv(shards, model, tmp_path, "nan", "--lr", "1e8", "--warmup", "0", *saves,
                                        "--log-every-n-steps", "100", "--check-every-n-steps", "3")])
    out = capsys.readouterr().out
    assert code == 3
    lines = [line for line in out.splitlines() if "Non-finite loss" in line]
    assert len(lines) == 1 and "optimizer step" in lines[0] and "last good checkpoint" in lines[0], out[-2000:]
    assert "End epoch" not in out  # nothing else is said about the broken epoch
    saved = sorted((tmp_path / "nan/checkpoints").iterdir())
    for path in saved:
        state = torch.load(path, weights_only=True)["state_dict"]
        assert all(torch.isfinite(t).all() for t in state.values() if t.is_floating_point()), path
    assert (saved[-1].name if saved else "none (this run saved nothing yet)") in lines[0]
    print(lines[0])


def test_mid_epoch_resume_counts_the_epochs_samples_from_that_epochs_schedule(setup, tmp_path):
    """The console's [n/N] after a resume inside epoch 1 equals the uninterrupted run's (batch sizes differ per
    epoch, so counting the skipped batches with another epoch's schedule would show another n)."""
    import re

    shards, model, _ = setup
    argv = ("--naflex-seq-lens", "16", "36", "--save-every-n-steps", "1", "--keep-last", "100")
    train_in_process(run_argv(shards, model, tmp_path, "whole", *argv))
    steps = sorted((tmp_path / "whole/checkpoints").glob("step_*.pt"), key=lambda p: int(p.stem[5:]))
    inside = next(p for p in steps if torch.load(p, weights_only=True).get("epoch") == 1 and
                  torch.load(p, weights_only=True).get("step_in_epoch", 0) > 0)
    train_in_process(run_argv(shards, model, tmp_path, "resumed", *argv, "--resume", str(inside)))

    def epoch_1_lines(name):
        text = (tmp_path / name / "out.log").read_text()
        return {m.group(2): m.group(1) for m in re.finditer(r"Train Epoch: 1 \[\s*(\d+)/\d+ .*?Step: (\d+)/", text)}

    whole, resumed = epoch_1_lines("whole"), epoch_1_lines("resumed")
    assert resumed and all(whole[step] == n for step, n in resumed.items()), (whole, resumed)


def test_a_resumed_epochs_averages_cover_the_whole_epoch(setup, tmp_path):
    """``End epoch`` after a resume inside the epoch averages every step of it, as the uninterrupted run's."""
    import re

    shards, model, _ = setup
    argv = ("--save-every-n-steps", "1", "--keep-last", "100", "--log-every-n-steps", "3")
    train_in_process(run_argv(shards, model, tmp_path, "whole", *argv))
    inside = next(p for p in sorted((tmp_path / "whole/checkpoints").glob("step_*.pt"))
                  if torch.load(p, weights_only=True).get("step_in_epoch") == 2)
    train_in_process(run_argv(shards, model, tmp_path, "resumed", *argv, "--resume", str(inside)))

    def averages(name):
        return re.findall(r"End epoch.*", (tmp_path / name / "out.log").read_text())

    whole, resumed = averages("whole"), averages("resumed")
    assert len(whole) == 2 and resumed == whole[-len(resumed):] and len(resumed) == 2, (whole, resumed)


def test_a_rollback_starts_a_branch_that_requeues_follow(setup, tmp_path, monkeypatch):
    """The rollback the non-finite and mid-epoch messages advise: back to epoch_1.pt of a 3-epoch run with a lower
    --lr and another --accum-freq, stopped inside the branch, requeued with --resume latest: the branch goes on
    (its step checkpoints survive pruning, latest follows it) and the abandoned checkpoints stay on disk."""
    shards, model, _ = setup
    saves = ("--save-every-n-steps", "2", "--keep-last", "2")
    train_in_process(run_argv(shards, model, tmp_path, "div", *saves, epochs=3))
    root, ckpts = tmp_path / "div", tmp_path / "div/checkpoints"
    further = ["epoch_2.pt", "epoch_3.pt", "step_10.pt", "step_12.pt"]
    assert ckpt_names(root) == ["epoch_1.pt", *further]
    old = {name: torch.load(ckpts / name, weights_only=True)["global_step"] for name in further}
    rollback = (*saves, "--lr", "5e-4", "--accum-freq", "1")  # 8 steps an epoch now
    signal_at(monkeypatch, signal.SIGTERM, 7)  # the branch's step 7 of epoch 1: global step 11
    cut = train_in_process(run_argv(shards, model, tmp_path, "div", *rollback, "--resume", str(ckpts / "epoch_1.pt"),
                                    epochs=3))
    monkeypatch.undo()
    assert cut["exit_code"] == EXIT_STOPPED and cut["global_step"] == 11
    assert ckpt_names(root) == ["abandoned-1", "epoch_1.pt", "epoch_latest.pt", "step_10.pt", "step_8.pt"]
    assert torch.load(ckpts / "step_10.pt", weights_only=True)["schedule"]["accum_freq"] == 1  # the branch's own
    log = (root / "out.log").read_text()
    assert "abandoned-1" in log and all(name in log for name in further)
    requeued = train_in_process(run_argv(shards, model, tmp_path, "div", *rollback, "--resume", "latest", epochs=3))
    assert requeued["exit_code"] == 0 and requeued["global_step"] == 20  # 4 + 8 + 8: the branch, to its end
    assert ckpt_names(root) == ["abandoned-1", "epoch_1.pt", "epoch_2.pt", "epoch_3.pt", "step_18.pt", "step_20.pt"]
    assert torch.load(ckpts / "epoch_3.pt", weights_only=True)["global_step"] == 20
    assert {name: torch.load(ckpts / "abandoned-1" / name, weights_only=True)["global_step"]
            for name in further} == old  # nothing of the abandoned run lost


def test_a_bit_flipped_checkpoint_is_refused_and_latest_falls_back(setup, tmp_path, capsys):
    shards, model, _ = setup
    argv = ("--save-every-n-steps", "2", "--keep-last", "2")
    train_in_process(run_argv(shards, model, tmp_path, "flip", *argv, epochs=1, workers=0))
    newest = tmp_path / "flip/checkpoints/epoch_1.pt"
    before = torch.load(newest, weights_only=True)["state_dict"]["token_embedding.weight"]
    flip_values(newest, "token_embedding.weight")
    after = torch.load(newest, weights_only=True)["state_dict"]["token_embedding.weight"]  # still loads
    assert int((before != after).sum()) == 16
    capsys.readouterr()
    code = cli_main(["train", *run_argv(shards, model, tmp_path, "flip", *argv, "--resume", str(newest), workers=0)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and "Traceback" not in err, err
    assert f"--resume {newest}: damaged: archive/data/" in err and "does not match the CRC-32" in err
    assert "changed after it was written" in err
    result = train_in_process(run_argv(shards, model, tmp_path, "flip", *argv, "--resume", "latest", workers=0))
    out = capsys.readouterr().out
    assert result["exit_code"] == 0 and result["global_step"] == 8
    assert "skipping" in out and "epoch_1.pt: damaged: archive/data/" in out and "resumed from" in out
    assert "step_4.pt" in out.split("resumed from")[1].splitlines()[0]


def test_latest_never_restarts_a_run_whose_checkpoints_are_all_abandoned(setup, tmp_path, capsys):
    """A top level emptied (by hand, or a branch start that died) while abandoned-N/ holds the run: --resume latest
    refuses in one line instead of training from scratch in a folder with a history."""
    shards, model, _ = setup
    train_in_process(run_argv(shards, model, tmp_path, "gone", "--train-num-samples", "32", epochs=1, workers=0))
    ckpts = tmp_path / "gone/checkpoints"
    (ckpts / "abandoned-1").mkdir()
    (ckpts / "epoch_1.pt").rename(ckpts / "abandoned-1/epoch_1.pt")
    capsys.readouterr()
    code = cli_main(["train", *run_argv(shards, model, tmp_path, "gone", "--train-num-samples", "32", "--resume",
                                        "latest", workers=0)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0, err
    assert "holds no loadable checkpoint of the current branch, only abandoned ones (in abandoned-1/)" in err
    assert sorted(p.name for p in ckpts.iterdir()) == ["abandoned-1"]
