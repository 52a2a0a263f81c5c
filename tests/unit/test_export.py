"""``naflex-accum export``: a checkpoint saved as the trainer saves it, exported, loaded back by open_clip 3.3.0
(``local-dir:``) and timm, gives the original model's features (at every patch size it was trained with);
wrapped checkpoints export the same; bad inputs are one line, exit 2, and leave DIR as it was."""
import json
from types import SimpleNamespace

import open_clip
import pytest
import timm
import torch
from safetensors.torch import load_file

from naflex_accum import cli
from naflex_accum.commands.export import export
from naflex_accum.data.patches import collate_images, resize_for_seq
from naflex_accum.models import create_model, register
from naflex_accum.train.checkpoint import save_checkpoint
from naflex_accum.train.resume import epoch_payload


def run_folder(tmp_path, model, model_name="naflex-tiny", edit=dict, patch_sizes=None, schedule=None, recorded=None):
    """``tmp_path/run`` as the trainer leaves it: params.txt (with ``patch_sizes``, --naflex-patch-sizes) and
    checkpoints/epoch_1.pt (``edit`` changes the state_dict, as a wrapper would have; ``schedule``, a mid-epoch
    checkpoint's; ``recorded``, the sizes the checkpoint itself records: none, as checkpoints before it had)."""
    root = tmp_path / "run"
    (root / "checkpoints").mkdir(parents=True)
    sizes = f"naflex_patch_sizes: {patch_sizes}\n" if patch_sizes is not None else ""
    (root / "params.txt").write_text(f"lr: 0.001\nmodel: {model_name}\n{sizes}name: run\n")
    optimizer = torch.optim.AdamW(model.parameters())
    state = SimpleNamespace(epoch=1, global_step=3, samples_seen=48, lr_steps_per_epoch=3, optimizer=optimizer,
                            scaler=None)
    payload = epoch_payload(state, model, SimpleNamespace(name="run", naflex_patch_sizes=[16]))
    payload.pop("naflex_patch_sizes", None)
    if recorded is not None:
        payload["naflex_patch_sizes"] = recorded
    payload["state_dict"] = edit(payload["state_dict"])
    if schedule is not None:
        payload["schedule"] = schedule
    path = root / "checkpoints" / "epoch_1.pt"
    save_checkpoint(path, payload)
    return path


def trained(siglip=False, patch_sizes=None):
    """The trainer's model (``patch_sizes``: --naflex-patch-sizes), trained a little."""
    torch.manual_seed(0)
    model = create_model("naflex-tiny", siglip=siglip, patch_sizes=patch_sizes).eval()
    with torch.no_grad():  # away from the initial values a fresh model would also have
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def batch():
    g = torch.Generator().manual_seed(1)
    images = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g) for h, w in ((64, 48), (32, 64))]
    return collate_images(images, seq_len=16), torch.randint(1, 49407, (2, 32), generator=g), \
        torch.randn(2, 3, 64, 64, generator=g)


def trainer_patches(patch_size):
    """Two images as the trainer batches them with several patch sizes: resized to the sequence, unflattened."""
    g = torch.Generator().manual_seed(2)
    images = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g) for h, w in ((64, 48), (40, 72))]
    return collate_images([resize_for_seq(image, 24, patch_size) for image in images], seq_len=24,
                          patch_size=patch_size, flatten=False)


def close(a, b):
    return torch.allclose(a, b, atol=1e-5, rtol=1e-5)


def one_dim_logits(state_dict):
    """A sharded (FSDP) model's state_dict: 1-dim logit parameters."""
    return {k: v.reshape(1) if k in ("logit_scale", "logit_bias") else v for k, v in state_dict.items()}


SIZES = [8, 16, 32]
RUNS = {"clip": (False, dict), "siglip": (True, dict), "siglip-fsdp": (True, one_dim_logits),
        "clip-compiled": (False, lambda sd: {"_orig_mod." + k: v for k, v in sd.items()})}


def load_export(folder):
    register()
    model = open_clip.create_model_and_transforms(f"local-dir:{folder}")[0]
    tower = timm.create_model(f"local-dir:{folder / 'timm'}", pretrained=True)
    configs = [json.loads((folder / name).read_text()) for name in ("open_clip_config.json", "timm/config.json")]
    return model.eval(), tower.eval(), configs


@pytest.mark.parametrize("run", list(RUNS))
def test_every_trained_patch_size_loads_in_open_clip_and_timm(tmp_path, run):
    """--naflex-patch-sizes 8 16 32: at each size, the trainer's patch dicts give the trainer's model's features."""
    siglip, edit = RUNS[run]
    model = trained(siglip, SIZES)
    export(run_folder(tmp_path, model, edit=edit, patch_sizes=SIZES), tmp_path / "out")
    loaded, tower, configs = load_export(tmp_path / "out")
    with torch.no_grad():
        for size in SIZES:
            patches = trainer_patches(size)
            assert close(loaded.encode_image(patches), model.encode_image(patches)), size
            assert close(tower(patches), model.visual.trunk(patches)), size
    assert [config["naflex_patch_sizes"] for config in configs] == [SIZES, SIZES]
    assert configs[1]["model_args"]["enable_patch_interpolator"] is True
    # built with the interpolator (timm's build-time option), not given one after: timm knows it takes any size
    assert model.visual.trunk.supports_patch_interpolation and tower.supports_patch_interpolation


def test_a_mid_epoch_checkpoint_records_its_sizes_in_its_schedule(tmp_path):
    """No params.txt (--model given): the checkpoint's own schedule names the sizes."""
    model = trained(True, [8, 16])
    path = run_folder(tmp_path, model, schedule={"naflex_patch_sizes": [8, 16], "seed": 0})
    (tmp_path / "run" / "params.txt").unlink()
    export(path, tmp_path / "out", "naflex-tiny")
    loaded, tower, configs = load_export(tmp_path / "out")
    with torch.no_grad():
        patches = trainer_patches(8)
        assert close(loaded.encode_image(patches), model.encode_image(patches))
        assert close(tower(patches), model.visual.trunk(patches))
    assert configs[0]["naflex_patch_sizes"] == [8, 16]


def test_the_checkpoints_own_record_of_its_sizes_comes_first(tmp_path):
    """A run resumed with more sizes: its first params.txt says 16, the checkpoint 8 16 (and a schedule 16, as a
    mid-epoch checkpoint of before the resume would have)."""
    model = trained(False, [8, 16])
    export(run_folder(tmp_path, model, patch_sizes=[16], recorded=[8, 16], schedule={"naflex_patch_sizes": [16]}),
           tmp_path / "out")
    loaded, tower, configs = load_export(tmp_path / "out")
    with torch.no_grad():
        patches = trainer_patches(8)
        assert close(loaded.encode_image(patches), model.encode_image(patches))
    assert configs[0]["naflex_patch_sizes"] == configs[1]["naflex_patch_sizes"] == [8, 16]


@pytest.mark.parametrize("record, sizes", [(None, None), ("None", None), ([16], [16])],
                         ids=["no-record", "upstream-default", "one-size"])
def test_one_patch_size_exports_the_plain_tower(tmp_path, record, sizes):
    """One size, or a run that recorded none (upstream's params.txt says None): the model's own tower, as open_clip
    and timm name it."""
    export(run_folder(tmp_path, trained(), patch_sizes=record), tmp_path / "out")
    loaded, tower, configs = load_export(tmp_path / "out")
    assert configs[0]["model_cfg"]["vision_cfg"]["timm_model_name"] == "naflexvit_tiny_patch16_gap"
    assert configs[0].get("naflex_patch_sizes") == configs[1].get("naflex_patch_sizes") == sizes
    assert "enable_patch_interpolator" not in configs[1]["model_args"]


@pytest.mark.parametrize("siglip", [False, True], ids=["clip", "siglip"])
def test_open_clip_and_timm_load_the_export_and_give_the_models_features(tmp_path, siglip):
    model = trained(siglip)
    export(run_folder(tmp_path, model), tmp_path / "out")
    register()
    loaded, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{tmp_path / 'out'}")
    loaded.eval()
    patches, tokens, dense = batch()
    with torch.no_grad():
        assert close(loaded.encode_image(patches), model.encode_image(patches))
        assert close(loaded.encode_image(dense), model.encode_image(dense))
        assert close(loaded.encode_text(tokens), model.encode_text(tokens))
        assert torch.equal(loaded.logit_scale, model.logit_scale)
        if siglip:
            assert torch.equal(loaded.logit_bias, model.logit_bias)
        else:
            assert loaded.logit_bias is None
        trunk = model.visual.trunk(patches)
        towers = [timm.create_model(f"local-dir:{tmp_path / 'out' / 'timm'}", pretrained=True),
                  timm.create_model("naflexvit_tiny_patch16_gap", pretrained=True, num_classes=0,
                                    pretrained_cfg_overlay=dict(file=str(tmp_path / "out/timm/model.safetensors")))]
        for tower in towers:
            assert close(tower.eval()(patches), trunk)
    openai = [0.48145466, 0.4578275, 0.40821073]  # the trainer's image statistics (data.patches)
    assert preprocess.transforms[-1].mean == openai and list(towers[0].pretrained_cfg["mean"]) == openai
    trunk_keys = set(load_file(str(tmp_path / "out/timm/model.safetensors")))
    assert trunk_keys == {k[len("visual.trunk."):] for k in model.state_dict() if k.startswith("visual.trunk.")}


@pytest.mark.parametrize("prefix", ["module.", "_orig_mod.", "module._orig_mod.", "_orig_mod.module."])
def test_a_wrapped_models_checkpoint_exports_as_the_plain_one(tmp_path, prefix):
    model = trained()
    (tmp_path / "plain").mkdir()
    export(run_folder(tmp_path / "plain", model), tmp_path / "plain-out")
    export(run_folder(tmp_path, model, edit=lambda sd: {prefix + k: v for k, v in sd.items()}), tmp_path / "out")
    a, b = load_file(str(tmp_path / "plain-out/open_clip_model.safetensors")), \
        load_file(str(tmp_path / "out/open_clip_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_sharded_models_checkpoint_exports(tmp_path):
    """A sharded (FSDP) model's 1-dim logit parameters load into the plain model's 0-dim ones."""
    model = trained(siglip=True)
    export(run_folder(tmp_path, model, edit=one_dim_logits), tmp_path / "out")
    weights = load_file(str(tmp_path / "out/open_clip_model.safetensors"))
    assert weights["logit_scale"].shape == model.logit_scale.shape


def test_model_flag_and_a_checkpoint_outside_a_run_folder(tmp_path, capsys):
    path = run_folder(tmp_path, trained())
    (tmp_path / "run" / "params.txt").unlink()
    assert cli.main(["export", str(path), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "pass --model" in err and not (tmp_path / "out").exists()
    assert cli.main(["export", str(path), str(tmp_path / "out"), "--model", "naflex-tiny"]) == 0
    assert "open_clip.create_model_and_transforms('local-dir:" in capsys.readouterr().out
    assert json.loads((tmp_path / "out/open_clip_config.json").read_text())["model_cfg"]["embed_dim"] == 32


def test_an_empty_dir_gets_the_files_and_an_exports_config_names_the_model(tmp_path):
    path = run_folder(tmp_path, trained())
    (tmp_path / "empty").mkdir()
    assert export(path, tmp_path / "empty") == ["open_clip_config.json", "open_clip_model.safetensors",
                                                "timm/config.json", "timm/model.safetensors"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folder left
    export(path, tmp_path / "again", str(tmp_path / "empty" / "open_clip_config.json"))
    a, b = (load_file(str(tmp_path / name / "open_clip_model.safetensors")) for name in ("empty", "again"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _bad_inputs(tmp_path):
    path = run_folder(tmp_path, trained())
    text = tmp_path / "notes.pt"
    text.write_text("not a checkpoint\n")
    full = tmp_path / "full"
    full.mkdir()
    (full / "mine.txt").write_text("keep me")
    garbage, other = tmp_path / "garbage.json", tmp_path / "other.json"
    garbage.write_text("{oops")
    other.write_text('{"lr": 0.1}')
    empty = tmp_path / "empty.pt"
    torch.save({"epoch": 1, "state_dict": {"a": 1}, "optimizer": {}}, empty)
    bad_sizes = run_folder(tmp_path / "bad", trained(), patch_sizes="[8, x]")
    return {
        "missing": ([str(tmp_path / "nope.pt"), str(tmp_path / "o1")], "no such file"),
        "not a checkpoint": ([str(text), str(tmp_path / "o2")], "not a torch checkpoint"),
        "no tensors": ([str(empty), str(tmp_path / "o7"), "--model", "naflex-tiny"], "holds no tensors"),
        "DIR not empty": ([str(path), str(full)], "is not empty"),
        "DIR a file": ([str(path), str(text)], "is not a folder"),
        "another model": ([str(path), str(tmp_path / "o3"), "--model", "naflex-S-16"], "does not fit"),
        "unknown model": ([str(path), str(tmp_path / "o4"), "--model", "nope"], "no such model config"),
        "JSON garbage": ([str(path), str(tmp_path / "o5"), "--model", str(garbage)], "cannot read it as JSON"),
        "JSON not a model": ([str(path), str(tmp_path / "o6"), "--model", str(other)], "not an open_clip model"),
        "patch sizes": ([str(bad_sizes), str(tmp_path / "o8")], "naflex_patch_sizes '[8, x]' is not a list of patch"),
    }


@pytest.mark.parametrize("case", ["missing", "not a checkpoint", "DIR not empty", "DIR a file", "another model",
                                  "unknown model", "JSON garbage", "JSON not a model",
                                  "no tensors", "patch sizes"])
def test_bad_inputs_are_one_line_exit_2_and_touch_nothing(tmp_path, capsys, case):
    argv, said = _bad_inputs(tmp_path)[case]
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert cli.main(["export", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("naflex-accum export: error: ") and said in err, err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    assert (tmp_path / "full" / "mine.txt").read_text() == "keep me"
