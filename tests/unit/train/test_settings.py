"""Every bad setting is one line and exit 2, found before the run folder is created or changed."""

import json

import pytest
from longrun_common import dropout_model, make_shards, run_argv, train_in_process

from naflex_accum.cli import main as cli_main


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Shards and the dropout model; the tests train in this process, without loader workers."""
    folder = tmp_path_factory.mktemp("settings")
    return make_shards(folder), dropout_model(folder)


def exit_2_one_line(capsys, argv, *needles):
    code = cli_main(["train", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.count("\n") == 0 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


def test_preset_values_are_parsed_like_flags(tmp_path):
    from naflex_accum.train.config.params import parse_args

    (tmp_path / "p.yaml").write_text("precision: amp_bfloat16\nnaflex-seq-lens: 16\nlogs-dir: /x\nsiglip: false\n"
                                     "grad-clip-norm: 1\n")
    args = parse_args(["--train-data", "d.tar", "--config", str(tmp_path / "p.yaml")])
    assert (args.precision, args.naflex_seq_lens, args.logs, args.siglip) == ("amp_bfloat16", [16], "/x", False)
    assert isinstance(args.grad_clip_norm, float)


@pytest.mark.parametrize("flags,needle", [
    (["--naflex-seq-len-probs", "1", "-1", "1"], "--naflex-seq-len-probs [1.0, -1.0, 1.0] must be non-negative"),
    (["--naflex-seq-lens", "64", "--naflex-max-tokens-per-batch", "256"], "--naflex-seq-lens 64 with "
     "--naflex-max-tokens-per-batch 256 and --naflex-batch-divisor 8 gives a batch size of 0"),
])
def test_data_settings_are_refused_as_they_are_parsed(flags, needle):
    """data/'s one check of the data flags runs on the command line, before a model or a folder is made (the
    shards are not read: they need not exist)."""
    from naflex_accum.errors import UsageError
    from naflex_accum.train.config.params import parse_args

    with pytest.raises(UsageError) as info:
        parse_args(["--train-data", "absent.tar", *flags])
    assert needle in str(info.value)


def test_siglip_follows_the_model_config(tmp_path):
    from naflex_accum.models import load_config
    from naflex_accum.train.config.params import parse_args

    config = load_config("naflex-tiny")
    config.update(init_logit_bias=-10.0)
    (tmp_path / "tiny-siglip.json").write_text(json.dumps(config))
    base = ["--train-data", "d.tar", "--model", str(tmp_path / "tiny-siglip.json")]
    assert parse_args(base).siglip is True
    assert parse_args([*base, "--no-siglip"]).siglip is False
    assert parse_args(["--train-data", "d.tar"]).siglip is False
    assert parse_args(["--train-data", "d.tar", "--model", "naflex-B-16-SigLIP"]).siglip is True


def test_resume_into_another_model_names_the_mismatch(setup, tmp_path, capsys):
    from naflex_accum.models import load_config

    shards, model = setup
    train_in_process(run_argv(shards, model, tmp_path, "a", epochs=1, workers=0))
    config = load_config("naflex-tiny")
    config["embed_dim"] = 48
    (tmp_path / "wide.json").write_text(json.dumps(config))
    argv = run_argv(shards, str(tmp_path / "wide.json"), tmp_path, "b", "--resume",
                    str(tmp_path / "a/checkpoints/epoch_1.pt"), workers=0)
    exit_2_one_line(capsys, argv, "epoch_1.pt does not fit --model", "2 with another shape (text_projection: "
                    "file [32, 32] vs model [32, 48], visual.head.proj.weight: file [32, 32] vs model [48, 32])")
    assert not (tmp_path / "b").exists()
    argv = run_argv(shards, model, tmp_path, "c", "--resume", str(tmp_path / "a/checkpoints/epoch_1.pt"), "--siglip",
                    workers=0)
    exit_2_one_line(capsys, argv, "does not fit --model", "1 missing (logit_bias)")


def test_mid_epoch_resume_with_other_schedule_settings_is_refused(setup, tmp_path, capsys):
    shards, model = setup
    train_in_process(run_argv(shards, model, tmp_path, "a", "--save-every-n-steps", "1", "--keep-last", "4",
                              epochs=1, workers=0))
    step = str(tmp_path / "a/checkpoints/step_3.pt")
    err = exit_2_one_line(capsys, run_argv(shards, model, tmp_path, "b", "--resume", step, "--accum-freq", "4",
                                           "--seed", "5", "--workers", "1"),
                          "saved at step 3 inside epoch 0", "--accum-freq 2 (now 4)", "--seed 0 (now 5)")
    assert "--workers" not in err  # it may differ: the batches do not depend on it (data.order)
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("device,needles", [
    ("cuda", ["--device cuda: no CUDA GPU is visible to this process", "use --device cpu"]),
    ("cuda:99", ["--device cuda:99"]),  # no GPU here; past the last one on a GPU machine
    ("gpu", ["--device 'gpu' is not a device; valid: cpu, cuda, cuda:N"]),
    ("meta", ["--device meta: the trainer runs on cpu or cuda"]),
])
def test_a_device_that_is_not_there_is_one_line_before_the_run_folder(setup, tmp_path, capsys, device, needles):
    import torch

    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    shards, model = setup
    exit_2_one_line(capsys, [*run_argv(shards, model, tmp_path / "logs", "run", workers=0), "--device", device],
                    *needles)
    assert not (tmp_path / "logs").exists()


def captionless_shards(shards, folder):
    """The reference shards without their .txt members: the index counts the samples, the first batch has none."""
    import tarfile
    from pathlib import Path

    folder.mkdir()
    source = Path(shards.train.replace("{000000..000000}", "000000"))
    with tarfile.open(source) as tar, tarfile.open(folder / source.name, "w") as out:
        for member in tar.getmembers():
            if not member.name.endswith(".txt"):
                out.addfile(member, tar.extractfile(member))
    return str(folder / source.name)


@pytest.mark.parametrize("resume", [(), ("--resume", "latest")])
def test_a_start_refused_late_leaves_no_run_folder(setup, tmp_path, capsys, resume):
    """A data error found at the first batch (exit 2) removes what the start created; the same --name then
    starts again (not 'already exists')."""
    shards, model = setup
    nocap = captionless_shards(shards, tmp_path / "nocap")
    argv = run_argv(shards, model, tmp_path / "logs", "run", *resume, epochs=1, workers=0)
    argv[argv.index("--train-data") + 1] = nocap
    for _ in range(2):
        exit_2_one_line(capsys, argv, "--train-data: no usable sample left", "missing caption (.txt)")
        assert not (tmp_path / "logs").exists()


def test_a_resume_refused_late_keeps_its_folder_and_removes_a_new_one(setup, tmp_path, capsys):
    """A resumed folder keeps everything, its log included; a new folder resumed from another run's checkpoint
    goes."""
    shards, model = setup
    nocap = captionless_shards(shards, tmp_path / "nocap")
    train_in_process(run_argv(shards, model, tmp_path, "kept", epochs=1, workers=0))
    before = sorted(p.name for p in (tmp_path / "kept").rglob("*"))
    argv = run_argv(shards, model, tmp_path, "kept", "--resume", "latest", epochs=2, workers=0)
    argv[argv.index("--train-data") + 1] = nocap
    exit_2_one_line(capsys, argv, "--train-data: no usable sample left")
    after = sorted(p.name for p in (tmp_path / "kept").rglob("*"))
    assert set(before) <= set(after) and "out.log" in after and "epoch_1.pt" in after
    # resumed from another run's checkpoint into a new folder (which links it in): the new folder goes too
    argv[argv.index("--name") + 1] = "other"
    argv[argv.index("--resume") + 1] = str(tmp_path / "kept/checkpoints/epoch_1.pt")
    exit_2_one_line(capsys, argv, "--train-data: no usable sample left")
    assert not (tmp_path / "other").exists() and (tmp_path / "kept/checkpoints/epoch_1.pt").is_file()


@pytest.mark.parametrize("resume", [(), ("--resume", "latest")])
def test_a_run_folder_path_that_is_a_file(setup, tmp_path, capsys, resume):
    shards, model = setup
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs/run").write_text("mine")
    exit_2_one_line(capsys, run_argv(shards, model, tmp_path / "logs", "run", *resume, workers=0),
                    f"--logs-dir {tmp_path / 'logs'} --name run: {tmp_path / 'logs/run'} is a file, not a folder")
    assert (tmp_path / "logs/run").read_text() == "mine"


def test_resume_params_files_are_never_overwritten(setup, tmp_path):
    shards, model = setup
    one = ("--train-num-samples", "32")  # one step an epoch
    train_in_process(run_argv(shards, model, tmp_path, "p", *one, epochs=1, workers=0))
    epoch_1 = str(tmp_path / "p/checkpoints/epoch_1.pt")
    for lr in ("0.0005", "0.0002"):
        train_in_process(run_argv(shards, model, tmp_path, "p", *one, "--resume", epoch_1, "--lr", lr, workers=0))
    root = tmp_path / "p"
    assert sorted(p.name for p in root.glob("params*.txt")) == ["params-resume-epoch_1-2.txt",
                                                                 "params-resume-epoch_1.txt", "params.txt"]
    assert "lr: 0.0005" in (root / "params-resume-epoch_1.txt").read_text()
    assert "lr: 0.0002" in (root / "params-resume-epoch_1-2.txt").read_text()
    assert "lr: 0.001" in (root / "params.txt").read_text()


@pytest.mark.parametrize("flag", ["--resume", "--pretrained"])
def test_a_text_file_given_as_a_checkpoint_is_one_line(setup, tmp_path, capsys, flag):
    shards, model = setup
    (tmp_path / "notes.txt").write_text("epoch 3 looked good\n")
    exit_2_one_line(capsys, run_argv(shards, model, tmp_path, "run", flag, str(tmp_path / "notes.txt"), workers=0),
                    f"{flag} {tmp_path / 'notes.txt'}: not a torch checkpoint or safetensors file (it starts with "
                    f"'epoch 3 looked good")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("extra,needle", [
    (["--grad-clip-norm", "-1"], "--grad-clip-norm must be a finite norm > 0"),
    (["--grad-clip-norm", "0"], "--grad-clip-norm must be a finite norm > 0"),
    (["--grad-clip-norm", "nan"], "--grad-clip-norm must be a finite norm > 0"),
    (["--lr", "inf"], "--lr must be a finite number > 0"),
    (["--wd", "nan"], "--wd must be a finite number >= 0"),
    (["--wd", "-1"], "--wd must be a finite number >= 0"),
    (["--beta1", "1.5"], "--beta1 must be in [0, 1)"),
    (["--beta2", "-0.5"], "--beta2 must be in [0, 1)"),
    (["--eps", "-1"], "--eps must be a finite number > 0"),
    (["--eps", "0"], "--eps must be a finite number > 0"),
    (["--val-seq-len", "100000"], "--val-seq-len 100000 exceeds --naflex-max-tokens-per-batch 256"),
])
def test_optimizer_and_eval_values_outside_their_range_are_one_line(setup, tmp_path, capsys, extra, needle):
    """Red before: a negative clip norm trained the loss upwards, exit 0; --beta1 1.5 was AdamW's traceback;
    --val-seq-len 100000 ran out of memory at the first evaluation, after an epoch of training."""
    shards, model = setup
    exit_2_one_line(capsys, run_argv(shards, model, tmp_path, "r", *extra, workers=0), needle)
    assert not (tmp_path / "r").exists()


def test_a_name_longer_than_a_folder_name_is_one_line(setup, tmp_path, capsys):
    shards, model = setup
    exit_2_one_line(capsys, run_argv(shards, model, tmp_path, "x" * 300, workers=0),
                    "--name is 300 bytes long: a folder name holds at most 255")


@pytest.mark.parametrize("name", ["", ".", "..", "a/b"])
def test_a_name_that_is_no_folder_name_says_why(name):
    """'' and '.' were told to drop a '/' they do not have."""
    from naflex_accum.errors import UsageError
    from naflex_accum.train.config.params import parse_args

    with pytest.raises(UsageError, match=r"use a plain folder name \(not empty, '\.' or '\.\.', no '/'\)"):
        parse_args(["--train-data", "absent.tar", "--name", name])


def test_one_patch_size_other_than_the_models_is_one_line(setup, tmp_path, capsys):
    """Red before: a shape traceback at the first forward (a flattened 7x7 patch against a 16x16 embedding)."""
    shards, model = setup
    exit_2_one_line(capsys, run_argv(shards, model, tmp_path, "p", "--naflex-patch-sizes", "7", workers=0),
                    "--naflex-patch-sizes 7: --model", "embeds 16-pixel patches; give 16, or several sizes (e.g. 7 16)")
    assert not (tmp_path / "p").exists()


def test_several_patch_sizes_without_a_timm_tower_is_one_line(setup, tmp_path, capsys):
    """Red before: an AttributeError traceback (an open_clip ViT tower has no timm trunk to resample)."""
    shards, _ = setup
    vit = tmp_path / "vit.json"
    vit.write_text(json.dumps({"embed_dim": 32, "vision_cfg": {"image_size": 32, "patch_size": 16, "layers": 1,
                                                               "width": 32, "head_width": 16},
                               "text_cfg": {"context_length": 32, "width": 32, "heads": 2, "layers": 1}}))
    exit_2_one_line(capsys, run_argv(shards, str(vit), tmp_path, "v", "--naflex-patch-sizes", "8", "16", workers=0),
                    "--naflex-patch-sizes 8 16: several patch sizes need a timm NaFlexVit image tower")
    assert not (tmp_path / "v").exists()
