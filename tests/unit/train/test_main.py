"""End to end: the built-in trainer on tiny demo shards (CPU, fp32, workers=0)."""

import pytest
import torch

from naflex_accum.cli import main as cli_main


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from naflex_accum.data import write_demo_data
    return write_demo_data(tmp_path_factory.mktemp("demo") / "data", num_samples=160, val_samples=48, seed=0)


def argv(shards, logs, name, *extra):
    return ["--train-data", shards.train, "--val-data", shards.val, "--model", "naflex-tiny",
            "--naflex-seq-lens", "16", "--naflex-max-tokens-per-batch", "256", "--naflex-batch-divisor", "1",
            "--train-num-samples", "128", "--epochs", "2", "--workers", "0", "--device", "cpu",
            "--lr", "1e-3", "--warmup", "2", "--logs", str(logs), "--name", name, "--log-every-n-steps", "1",
            "--val-seq-len", "16", "--val-batch-size", "24", *extra]


def train(args):
    from naflex_accum.train.main import train as run_train
    return run_train(args)


def final_weights(path):
    return torch.load(path, map_location="cpu", weights_only=False)["state_dict"]


def assert_same_weights(a, b, atol):
    assert a.keys() == b.keys()
    worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    assert worst <= atol, f"weights differ by up to {worst:.3e}"
    return worst


def test_run_folder_checkpoints_and_tensorboard(shards, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result = train(argv(shards, tmp_path, "run", "--report-to", "tensorboard", "--accum-freq", "2",
                        "--naflex-loss-scale", "linear", "--batch-size", "32"))
    root = tmp_path / "run"
    assert (root / "out.log").read_text().count("Train Epoch:") >= 2
    assert "accum_freq: 2" in (root / "params.txt").read_text()
    ckpt = torch.load(root / "checkpoints" / "epoch_2.pt", weights_only=False)
    assert {"epoch", "global_step", "samples_seen", "name", "state_dict", "optimizer", "scaler"} <= ckpt.keys()
    assert ckpt["epoch"] == 2 and ckpt["name"] == "run" and ckpt["samples_seen"] == 2 * 128
    assert (root / "checkpoints" / "epoch_1.pt").is_file()
    assert not list((root / "checkpoints").glob(".*tmp*"))  # atomic writes leave nothing behind
    events = EventAccumulator(str(root / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag in ("train/loss", "train/lr", "train/logit_scale", "train/window_scale", "train/window_samples",
                "train/samples_per_second", "train/image_tokens_per_second", "val/image_to_text_R@1",
                "val/text_to_image_R@5"):
        assert tag in tags, tag
    scales = [e.value for e in events.Scalars("train/window_scale")]
    assert scales == pytest.approx([0.5] * len(scales))  # 256 // 16 = 16 per microbatch, over reference 32
    assert result["global_step"] == ckpt["global_step"]


def test_resume_latest_matches_uninterrupted(shards, tmp_path):
    extra = ("--accum-freq", "2", "--naflex-loss-scale", "linear", "--batch-size", "8")
    train(argv(shards, tmp_path, "run", *extra))
    ckpts = tmp_path / "run" / "checkpoints"
    uninterrupted = final_weights(ckpts / "epoch_2.pt")
    (ckpts / "epoch_2.pt").unlink()  # as if the run had stopped after epoch 1
    result = train(argv(shards, tmp_path, "run", *extra, "--resume", "latest"))
    assert result["epoch"] == 2
    assert_same_weights(final_weights(ckpts / "epoch_2.pt"), uninterrupted, atol=0.0)


def test_accum_freq_two_matches_double_budget(shards, tmp_path):
    """One sequence length, no loss scale: accum 2 at budget T equals accum 1 at budget 2T.

    Adam divides by sqrt(v), which turns fp32 round-off in near-zero gradients
    into visible noise, so the weights are compared by how far apart the two
    runs ended relative to how far they moved (a different example stream or
    a wrong window gives O(1) here).
    """
    base = ("--epochs", "1", "--naflex-loss-scale", "none")
    a = train(argv(shards, tmp_path, "accum", *base, "--accum-freq", "2", "--naflex-max-tokens-per-batch", "128"))
    b = train(argv(shards, tmp_path, "full", *base, "--accum-freq", "1", "--naflex-max-tokens-per-batch", "256"))
    train(argv(shards, tmp_path, "init", *base, "--naflex-max-tokens-per-batch", "256", "--lr", "1e-30"))
    assert a["global_step"] == b["global_step"] == 8
    assert a["epoch_losses"] == pytest.approx(b["epoch_losses"], rel=1e-5)
    wa, wb, w0 = (final_weights(tmp_path / f"{n}/checkpoints/epoch_1.pt") for n in ("accum", "full", "init"))
    apart = sum(((wa[k] - wb[k]).float() ** 2).sum() for k in wa) ** 0.5
    moved = sum(((wb[k] - w0[k]).float() ** 2).sum() for k in wa) ** 0.5
    print(f"accum 2 @ T vs accum 1 @ 2T: weights apart {apart:.3e}, moved {moved:.3e}")
    assert apart / moved < 2e-3


def test_checkpoint_loads_with_open_clip(shards, tmp_path):
    import open_clip

    from naflex_accum.models import CONFIG_DIR, register_timm_models

    train(argv(shards, tmp_path, "run", "--epochs", "1"))
    register_timm_models()  # the tiny size is ours; timm's own B/16 needs no registration
    open_clip.add_model_config(CONFIG_DIR)
    model = open_clip.create_model("naflex-tiny", pretrained=str(tmp_path / "run/checkpoints/epoch_1.pt"))
    assert_same_weights(model.state_dict(), final_weights(tmp_path / "run/checkpoints/epoch_1.pt"), atol=0.0)


def test_b16_state_dict_keys_match_open_clip():
    import open_clip

    from naflex_accum.models import CONFIG_DIR, create_model

    open_clip.add_model_config(CONFIG_DIR)
    with torch.device("meta"):  # shapes only: initialising 2 x 150M parameters would cost seconds
        ours = create_model("naflex-B-16")
    theirs = open_clip.create_model("naflex-B-16", device="meta")
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in theirs.state_dict().items()}


@pytest.mark.parametrize("extra,message", [
    (["--train-data", "/nonexistent/shard-{0000..0003}.tar"], "shard"),
    (["--naflex-loss-scale", "linear", "--batch-size", "0"], "positive --batch-size"),
    (["--naflex-loss-scale", "linear", "--batch-size", "-4"], "positive --batch-size"),
    (["--naflex-seq-lens", "512"], "--naflex-seq-lens"),
    (["--config", "no-such-preset"], "--config"),
    (["--precision", "fp8"], "--precision"),
    (["--torchcompile", "--torchcompile-mode", "bogus"], "--torchcompile-mode bogus: Unrecognized mode=bogus, should "
                                                          "be one of: default"),
    (["--torchcompile", "--torchcompile-backend", "bogus"], "--torchcompile-backend bogus: Invalid backend"),
])
def test_bad_inputs_exit_2_with_one_line(shards, tmp_path, capsys, extra, message):
    code = cli_main(["train", *argv(shards, tmp_path, "bad"), *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) in (1, 2) and message in err[-1] and "Traceback" not in "\n".join(err)


def test_existing_run_name_is_refused(shards, tmp_path, capsys):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "out.log").write_text("precious")
    assert cli_main(["train", *argv(shards, tmp_path, "taken")]) == 2
    err = capsys.readouterr().err
    assert "already exists" in err and "--resume latest" in err
    assert (tmp_path / "taken" / "out.log").read_text() == "precious"


def test_empty_shards_exit_2(tmp_path, capsys):
    import tarfile
    empty = tmp_path / "empty-0000.tar"
    tarfile.open(empty, "w").close()
    code = cli_main(["train", "--train-data", str(empty), "--train-num-samples", "8", "--workers", "0",
                     "--logs", str(tmp_path), "--name", "x", "--device", "cpu"])
    assert code == 2
    assert "Traceback" not in capsys.readouterr().err


def test_stop_file_is_cleared_on_start(shards, tmp_path):
    """A STOP file older than the launch (here, this process's start) is a request of an earlier start."""
    import os

    from naflex_accum.train.ending.preempt import launch_time

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "STOP").write_text("")
    os.utime(tmp_path / "run" / "STOP", (launch_time() - 60, launch_time() - 60))
    result = train(argv(shards, tmp_path, "run", "--epochs", "1", "--resume", "latest"))
    assert not result["preempted"] and result["epoch"] == 1


def test_a_folder_named_stop_is_no_request_and_is_left_with_a_warning(tmp_path, monkeypatch):
    """It was taken for a request, and its removal after the save raised (exit 1, not 75); every later start then
    failed the same way at its start."""
    from types import SimpleNamespace

    from naflex_accum.train.ending import preempt

    warned = []
    monkeypatch.setattr(preempt.log, "warning", warned.append)
    (tmp_path / "STOP").mkdir()
    stop = preempt.StopRequest(tmp_path / "STOP", SimpleNamespace(is_master=True))
    try:
        stop.clear()
        assert not stop.pending() and len(warned) == 1 and "STOP is not a file: it asks no stop" in warned[0]
        stop.signalled = "SIGTERM"
        assert stop.pending() and stop.reason() == "SIGTERM"
        stop.served()
    finally:
        stop.close()
    assert (tmp_path / "STOP").is_dir()


def test_a_stop_link_that_loops_is_no_request(tmp_path):
    """Red before: OSError (too many levels of symbolic links) at every start."""
    from types import SimpleNamespace

    from naflex_accum.train.ending import preempt

    (tmp_path / "STOP").symlink_to(tmp_path / "STOP")
    stop = preempt.StopRequest(tmp_path / "STOP", SimpleNamespace(is_master=True))
    try:
        stop.clear()
        assert not stop.pending()
    finally:
        stop.close()


@pytest.mark.parametrize("value", ["-inf", "nan", "inf", "abc"])
def test_a_launch_time_that_is_no_time_is_warned_and_not_used(monkeypatch, value):
    """-inf would make every STOP file newer than the launch, so a stale one would stop the run at once."""
    from naflex_accum.train.ending import preempt

    warned = []
    monkeypatch.setattr(preempt.log, "warning", warned.append)
    monkeypatch.setenv("NAFLEX_ACCUM_LAUNCHED", value)
    assert abs(preempt.launch_time() - preempt.process_start()) < 1
    assert len(warned) == 1 and f"$NAFLEX_ACCUM_LAUNCHED={value!r} is not a time in epoch seconds" in warned[0]
    monkeypatch.setenv("NAFLEX_ACCUM_LAUNCHED", "1000")
    assert preempt.launch_time() == 1000


@pytest.mark.parametrize("precision", ["amp", "amp_bf16"])
def test_mixed_precision_runs_on_cpu(shards, tmp_path, precision):
    """fp16 autocast with a GradScaler (saved in the checkpoint), and bf16 autocast, run end to end."""
    result = train(argv(shards, tmp_path, precision, "--epochs", "1", "--precision", precision, "--accum-freq", "2"))
    ckpt = torch.load(tmp_path / precision / "checkpoints" / "epoch_1.pt", weights_only=False)
    assert (ckpt["scaler"] is not None) == (precision == "amp")
    assert result["epoch_losses"] and all(v == v for v in result["epoch_losses"])  # no NaN


def test_several_patch_sizes_train(shards, tmp_path):
    """--naflex-patch-sizes 16 32: unflattened patches, the patch embedding resampled per size (FlexiViT)."""
    result = train(argv(shards, tmp_path, "ps", "--epochs", "1", "--naflex-patch-sizes", "16", "32",
                        "--naflex-seq-lens", "16", "--accum-freq", "2"))
    assert result["global_step"] > 0 and all(v == v for v in result["epoch_losses"])


def test_several_patch_sizes_evaluate_and_zero_shot_at_the_first_size(shards, tmp_path):
    """--naflex-patch-sizes 8 16: the held-out and zero-shot batches (at 8, not the tower's native 16) reach the
    tower as it takes them, unflattened, as training's do."""
    result = train(argv(shards, tmp_path, "ps816", "--epochs", "1", "--naflex-patch-sizes", "8", "16",
                        "--accum-freq", "2", "--zeroshot-classes", "demo-shapes", "--zeroshot-frequency", "1"))
    (epoch, metrics), = result["evals"]
    assert epoch == 1 and {"image_to_text_R@1", "clip_val_loss", "shapes-zeroshot-val-top1"} <= metrics.keys()


def test_a_run_resumed_with_more_patch_sizes_exports_them(shards, tmp_path):
    """Epoch 1 at the default size, epoch 2 resumed with --naflex-patch-sizes 8 16: each checkpoint records the
    sizes it was trained with, and epoch_2.pt exports the tower taking both (not the first params.txt's one)."""
    import json

    from naflex_accum.commands.export import export

    train(argv(shards, tmp_path, "more", "--epochs", "1", "--save-every-n-steps", "1"))
    train(argv(shards, tmp_path, "more", "--naflex-patch-sizes", "8", "16", "--resume", "latest"))
    ckpts = tmp_path / "more" / "checkpoints"
    recorded = {p.name: torch.load(p, weights_only=True)["naflex_patch_sizes"] for p in ckpts.glob("*.pt")}
    steps = [sizes for name, sizes in recorded.items() if name.startswith("step_")]  # mid-epoch ones too
    assert steps and steps[0] == recorded["epoch_1.pt"] == [16] and recorded["epoch_2.pt"] == [8, 16]
    export(ckpts / "epoch_2.pt", tmp_path / "out")
    config = json.loads((tmp_path / "out" / "open_clip_config.json").read_text())
    assert config["naflex_patch_sizes"] == [8, 16]
    assert config["model_cfg"]["vision_cfg"]["timm_model_name"].endswith("_flexi")
