"""Fine-tuning flags of the built-in trainer: --pretrained, --lock-*, --force-patch-dropout, --grad-checkpointing,
--dataset-resampled and --train-data-upsampling-factors."""

import pytest
import torch

from naflex_accum.errors import UsageError
from naflex_accum.train.ending.distributed import World
from naflex_accum.train.config.params import parse_args

BASE = ["--train-data", "x.tar", "--train-num-samples", "8", "--device", "cpu"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from naflex_accum.data import write_demo_data
    return write_demo_data(tmp_path_factory.mktemp("ft") / "data", num_samples=96, val_samples=24, seed=0)


def run_argv(shards, logs, name, *extra):
    return ["--train-data", shards.train, "--model", "naflex-tiny", "--naflex-seq-lens", "16",
            "--naflex-max-tokens-per-batch", "256", "--naflex-batch-divisor", "1", "--train-num-samples", "64",
            "--epochs", "1", "--workers", "0", "--device", "cpu", "--lr", "1e-2", "--warmup", "1",
            "--logs", str(logs), "--name", name, "--log-every-n-steps", "100", *extra]


def train(args):
    from naflex_accum.train.main import train as run_train
    return run_train(args)


def weights(path):
    return torch.load(path, map_location="cpu", weights_only=True)["state_dict"]


def build_model(*extra):
    from naflex_accum.train.main import build_task
    return build_task(parse_args([*BASE, *extra]), World(), torch.device("cpu"))[1]


def trainable(model):
    return {n for n, p in model.named_parameters() if p.requires_grad}


def test_pretrained_open_clip_state_dict_and_run_checkpoint(tmp_path):
    from naflex_accum.models import create_model

    torch.manual_seed(123)
    source = create_model("naflex-tiny").state_dict()
    torch.save(source, tmp_path / "open_clip.pt")
    torch.save({"epoch": 3, "state_dict": {f"module.{k}": v for k, v in source.items()}}, tmp_path / "epoch_3.pt")
    for path in (tmp_path / "open_clip.pt", tmp_path / "epoch_3.pt"):
        loaded = build_model("--pretrained", str(path)).state_dict()
        assert all(torch.equal(loaded[k], source[k]) for k in source)


@pytest.mark.parametrize("layout", ["naflexvit", "vit"])
def test_pretrained_timm_image_tower(tmp_path, layout):
    """timm weights (NaFlexVit, or a plain ViT that timm converts) fill the image tower; the rest keeps its init."""
    import timm
    from safetensors.torch import save_file

    from naflex_accum.models import register_timm_models

    register_timm_models()
    torch.manual_seed(5)
    if layout == "naflexvit":
        tower = timm.create_model("naflexvit_tiny_patch16_gap", num_classes=10)
    else:
        tower = timm.create_model("vit_tiny_patch16_224", embed_dim=32, depth=2, num_heads=2, global_pool="avg",
                                  reg_tokens=1, fc_norm=True, class_token=False, num_classes=10, img_size=256)
    save_file(tower.state_dict(), tmp_path / "tower.safetensors")
    fresh, model = build_model(), build_model("--pretrained", str(tmp_path / "tower.safetensors"))
    blocks = tower.state_dict()["blocks.1.mlp.fc2.weight"]
    assert torch.equal(model.visual.trunk.blocks[1].mlp.fc2.weight, blocks)
    assert not torch.equal(fresh.visual.trunk.blocks[1].mlp.fc2.weight, blocks)
    assert torch.equal(model.token_embedding.weight, fresh.token_embedding.weight)  # text tower: seeded init
    assert torch.equal(model.visual.head.proj.weight, fresh.visual.head.proj.weight)  # projection: init


@pytest.mark.parametrize("make,expect", [
    (lambda m: {k: v for k, v in m.items() if "blocks.1." not in k}, "missing (visual.trunk.blocks.1."),
    (lambda m: {**m, "extra.weight": torch.zeros(1)}, "1 unexpected (extra.weight)"),
    (lambda m: {**m, "token_embedding.weight": torch.zeros(49408, 64)},
     "token_embedding.weight: file [49408, 64] vs model [49408, 32]"),
    (lambda m: {"foo.weight": torch.zeros(1)}, "image tower (timm NaFlexVit)"),
])
def test_pretrained_mismatch_is_one_line_naming_keys(tmp_path, make, expect):
    from naflex_accum.models import create_model

    torch.save(make(create_model("naflex-tiny").state_dict()), tmp_path / "bad.pt")
    with pytest.raises(UsageError) as exc:
        build_model("--pretrained", str(tmp_path / "bad.pt"))
    message = str(exc.value)
    assert "\n" not in message and expect in message and "--model naflex-tiny" in message


@pytest.mark.parametrize("content,expect", [(None, "no such file"),
                                            (b"not a checkpoint", "not a torch checkpoint or safetensors file")])
def test_pretrained_bad_file(tmp_path, content, expect):
    path = tmp_path / "w.pt"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(UsageError, match=expect):
        build_model("--pretrained", str(path))


def test_resume_wins_over_pretrained(shards, tmp_path):
    from naflex_accum.models import create_model

    train(run_argv(shards, tmp_path, "base"))
    first = tmp_path / "base" / "checkpoints" / "epoch_1.pt"
    torch.manual_seed(99)
    torch.save(create_model("naflex-tiny").state_dict(), tmp_path / "other.pt")
    train(run_argv(shards, tmp_path, "plain", "--epochs", "2", "--resume", str(first)))
    train(run_argv(shards, tmp_path, "both", "--epochs", "2", "--resume", str(first),
                   "--pretrained", str(tmp_path / "other.pt")))
    plain, both = (weights(tmp_path / n / "checkpoints" / "epoch_2.pt") for n in ("plain", "both"))
    assert all(torch.equal(plain[k], both[k]) for k in plain)


def test_lock_groups_follow_upstream_main():
    """Upstream main: the projection is the top group of each tower and is frozen by a full lock."""
    model = build_model("--lock-image")
    assert not any(n.startswith("visual.") for n in trainable(model))
    assert any(n.startswith("transformer.") for n in trainable(model)) and "logit_scale" in trainable(model)
    assert {n for n in trainable(build_model("--lock-image", "--lock-image-unlocked-groups", "1"))
            if n.startswith("visual.")} == {"visual.head.proj.weight"}
    assert {n for n in trainable(build_model("--lock-image", "--lock-image-unlocked-groups", "2"))
            if n.startswith("visual.")} == {"visual.head.proj.weight", "visual.trunk.fc_norm.weight",
                                            "visual.trunk.fc_norm.bias"}
    text = {n for n in trainable(build_model("--lock-text")) if not n.startswith("visual.")}
    assert text == {"logit_scale"}
    text = {n for n in trainable(build_model("--lock-text", "--lock-text-unlocked-layers", "2"))
            if not n.startswith("visual.")}
    assert text == {"logit_scale", "text_projection", "ln_final.weight", "ln_final.bias"} | {
        n for n, _ in build_model().named_parameters() if n.startswith("transformer.resblocks.1.")}


@pytest.mark.parametrize("extra,message", [
    (["--lock-image-unlocked-groups", "1"], "no effect without --lock-image"),
    (["--lock-text", "--lock-text-unlocked-layers", "-1"], "must be an integer >= 0"),
    (["--lock-image", "--lock-text"], "only logit_scale"),
    (["--lock-image", "--lock-image-unlocked-groups", "5"], "unlocks all 5 layer groups"),
    (["--lock-text", "--lock-text-unlocked-layers", "4"], "unlocks all 4 layer groups"),
])
def test_bad_lock_flags(extra, message):
    with pytest.raises(UsageError, match=message):
        build_model(*extra)


def test_locked_parameters_stay_bit_identical_over_a_run(shards, tmp_path):
    from naflex_accum.models import create_model

    torch.manual_seed(7)
    init = create_model("naflex-tiny").state_dict()
    torch.save(init, tmp_path / "init.pt")
    train(run_argv(shards, tmp_path, "locked", "--pretrained", str(tmp_path / "init.pt"), "--lock-image",
                   "--lock-image-unlocked-groups", "1", "--lock-text", "--lock-text-unlocked-layers", "1",
                   "--accum-freq", "2", "--naflex-loss-scale", "linear", "--batch-size", "16"))
    ckpt = torch.load(tmp_path / "locked" / "checkpoints" / "epoch_1.pt", weights_only=True)
    after = ckpt["state_dict"]
    moving = {"visual.head.proj.weight", "text_projection", "logit_scale"}
    assert all(torch.equal(after[k], init[k]) for k in init if k not in moving)
    assert all(not torch.equal(after[k], init[k]) for k in moving)
    assert len(ckpt["optimizer"]["state"]) == len(moving)  # the optimizer holds the trainable parameters only


@pytest.mark.parametrize("mode", ["cached-loss", "replay"])
@pytest.mark.parametrize("loss,locks", [
    ("clip", dict(image=0, text=2)),        # whole image tower frozen: its features carry no gradient
    ("siglip", dict(image=2, text=None)),
    ("clip", dict(image=3, text=1, checkpointing=True)),
])
def test_accumulation_stays_exact_for_the_trainable_parameters(mode, loss, locks):
    """Raw gradients of the trainable parameters: accumulated over a split window == one full-batch backward."""
    from naflex_accum.accum.modes import get_step
    from naflex_accum.tasks import unwrap
    from naflex_accum.train.model.finetune import lock_image_tower, lock_text_tower
    from naflex_accum.upstream.audit import audit_case, default_task_factory

    def make_task(loss_name, stochastic):
        task = default_task_factory(loss_name, stochastic)
        model = unwrap(task.trainable_module)
        if locks.get("image") is not None:
            lock_image_tower(model, locks["image"])
        if locks.get("text") is not None:
            lock_text_tower(model, locks["text"])
        if locks.get("checkpointing"):
            model.set_grad_checkpointing(True)
        return task

    for split in ((2, 3), (3, 1, 2)):
        result = audit_case(get_step(mode), make_task, loss, "linear", split, stochastic=True)
        assert result.passed, result


def test_force_patch_dropout_overrides_the_config():
    assert build_model("--force-patch-dropout", "0.4").visual.trunk.patch_drop.prob == 0.4
    assert build_model().visual.trunk.patch_drop is None
    with pytest.raises(UsageError, match="--force-patch-dropout must be in"):
        parse_args([*BASE, "--force-patch-dropout", "1.0"])


def test_grad_checkpointing_uses_the_models_switch_and_keeps_gradients():
    from naflex_accum.tasks import create_task
    from naflex_accum.upstream.audit import random_batch

    plain, ckpt = build_model(), build_model("--grad-checkpointing")
    assert ckpt.visual.trunk.grad_checkpointing and ckpt.transformer.grad_checkpointing
    assert not plain.visual.trunk.grad_checkpointing and not plain.transformer.grad_checkpointing
    batch = random_batch(6, 16, torch.Generator().manual_seed(0))
    grads = []
    for model in (plain, ckpt):
        losses, _ = create_task(model)(batch)
        losses["loss"].backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert all(torch.allclose(grads[0][n], grads[1][n], rtol=1e-5, atol=1e-7) for n in grads[0])


def test_sampling_flags_reach_the_data_config(shards):
    from naflex_accum.train.main import build_data

    first, second = shards.train.replace("{000000..000000}", "000000"), shards.val.replace("{000000..000000}", "000000")
    two = f"{first}::{second}"
    args = parse_args([*BASE, "--train-num-samples", "64", "--train-data", two, "--workers", "0",
                       "--dataset-resampled", "--train-data-upsampling-factors", "1::2.5"])
    loader, _ = build_data(args, World(), build_model(), torch.device("cpu"))
    assert loader.cfg.dataset_resampled is True and loader.index.weights == [1.0, 2.5]  # one shard per source
    args = parse_args([*BASE, "--train-num-samples", "64", "--train-data", shards.train, "--workers", "0"])
    # resampling is off by default, as in open_clip
    loader, _ = build_data(args, World(), build_model(), torch.device("cpu"))
    assert loader.cfg.dataset_resampled is False and loader.cfg.upsampling_factors is None


@pytest.mark.parametrize("extra,message", [
    (["--train-data", "a.tar::b.tar", "--dataset-resampled", "--train-data-upsampling-factors", "1"],
     "2 '::'-joined sources"),
    (["--train-data", "a.tar::b.tar", "--dataset-resampled", "--train-data-upsampling-factors", "1::x"],
     "numbers joined by '::'"),
    (["--train-data", "a.tar::b.tar", "--dataset-resampled", "--train-data-upsampling-factors", "1::-1"], ">= 0"),
    (["--train-data", "a.tar::b.tar", "--train-data-upsampling-factors", "1::1"], "needs --dataset-resampled"),
])
def test_bad_sampling_flags(extra, message):
    with pytest.raises(UsageError, match=message):
        parse_args([*BASE, *extra])
