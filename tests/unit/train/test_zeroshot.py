"""Zero-shot classification during training: class lists, labelled shards and folders, metrics, frequency, demo."""

import io
import json
import tarfile
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

from naflex_accum.data import labelled
from naflex_accum.errors import UsageError
from naflex_accum.train import zeroshot
from naflex_accum.train.distributed import World


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from naflex_accum.data import write_demo_data
    return write_demo_data(tmp_path_factory.mktemp("zs") / "data", num_samples=96, val_samples=40, seed=0)


def eval_args(**overrides):
    args = dict(zeroshot_classes=None, zeroshot_data=None, val_data=None, imagenet_val=None, imagenet_v2=None,
                zeroshot_frequency=1, epochs=1, workers=0, val_seq_len=16, naflex_seq_lens=[16],
                naflex_patch_sizes=[16], val_batch_size=16, image_decode="scaled")
    return SimpleNamespace(**{**args, **overrides})


def tiny_task(seed=0, patch_sizes=None):
    from naflex_accum.models import create_model
    from naflex_accum.tasks import create_task

    torch.manual_seed(seed)
    return create_task(create_model("naflex-tiny", patch_sizes=patch_sizes))


def test_demo_class_list():
    from naflex_accum.data.demo import COLOURS, SHAPES

    classes = zeroshot.load_class_list("demo-shapes")
    assert classes.name == "shapes" and "red triangle" in classes.classnames
    assert len(classes.classnames) == len(COLOURS) * len(SHAPES)
    assert "a photo of a {}." in classes.templates and classes.json_label == "{colour} {shape}"


@pytest.mark.parametrize("text,message", [
    ("[1, 2]", "expected a mapping"),
    ("classnames: [a, b]\n", "'templates' must be a non-empty list"),
    ("classnames: [a, a]\ntemplates: ['{}']\n", "duplicates"),
    ("classnames: [a]\ntemplates: ['{}']\n", "at least 2"),
    ("classnames: [a, b]\ntemplates: ['a photo']\n", "exactly one '{}'"),
    ("classnames: [a, b]\ntemplates: ['{}']\nlabels: x\n", "unknown keys ['labels']"),
    ("classnames: [a, b\n", "not valid YAML/JSON"),
])
def test_bad_class_list_is_one_line(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(UsageError) as exc:
        zeroshot.load_class_list(str(path))
    assert message in str(exc.value) and "\n" not in str(exc.value) and str(path) in str(exc.value)


@pytest.mark.parametrize("sizes", [[16], [8, 16]], ids=str)
def test_zero_shot_matches_a_direct_computation(shards, sizes):
    """Top-1/top-5 from the evaluator equal a per-image loop over open_clip's encoders and our own classifier, at
    the first of --naflex-patch-sizes (unflattened for a tower of several sizes, as training's batches)."""
    from open_clip.tokenizer import SimpleTokenizer

    from naflex_accum.data.decode import decode_for_seq
    from naflex_accum.data.patches import collate_images
    from naflex_accum.data.samples import tar_members

    task = tiny_task(patch_sizes=sizes)
    model = task.trainable_module
    evaluator = zeroshot.make_zero_shot(eval_args(zeroshot_classes="demo-shapes", val_data=shards.val,
                                                  naflex_patch_sizes=sizes), model, World(), torch.device("cpu"))
    metrics = evaluator(task, 1, nullcontext)
    assert set(metrics) == {"shapes-zeroshot-val-top1", "shapes-zeroshot-val-top5"}
    assert model.training  # left in train mode

    classes = zeroshot.load_class_list("demo-shapes")
    tokenizer = SimpleTokenizer(context_length=model.context_length)
    model.eval()
    with torch.no_grad():
        embeds = torch.stack([model.encode_text(tokenizer([t.format(c) for t in classes.templates]), normalize=True)
                              .mean(0) for c in classes.classnames])
        embeds = embeds / embeds.norm(dim=1, keepdim=True)
        files, top1, top5 = {}, 0, 0
        url = shards.val.replace("{000000..000000}", "000000")
        for name, data in tar_members(url):
            files[name.rsplit(".", 1)[1]] = data
            if "json" in files and ("jpg" in files or "png" in files):
                attrs = json.loads(files["json"])
                label = classes.classnames.index(f"{attrs['colour']} {attrs['shape']}")
                image = decode_for_seq(files.get("jpg") or files["png"], 16, sizes[0])
                patches = collate_images([image], 16, sizes[0], flatten=len(sizes) == 1)
                ranked = (model.encode_image(patches, normalize=True) @ embeds.t()).argsort(descending=True)[0]
                top1 += int(ranked[0] == label)
                top5 += int(label in ranked[:5])
                files = {}
    assert metrics["shapes-zeroshot-val-top1"] == pytest.approx(top1 / 40)
    assert metrics["shapes-zeroshot-val-top5"] == pytest.approx(top5 / 40)


def write_cls_shard(path, labels):
    from naflex_accum.data.demo import render_sample

    with tarfile.open(path, "w") as tar:
        for i, label in enumerate(labels):
            data, ext, _ = render_sample(0, "cls", i)
            for name, payload in ((f"s{i:04d}.{ext}", data), (f"s{i:04d}.cls", str(label).encode())):
                info = tarfile.TarInfo(name)
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))


def test_cls_labels_and_skipped_samples(tmp_path, caplog):
    classes = tmp_path / "c.yaml"
    classes.write_text("name: three\nclassnames: [cat, dog, bird]\ntemplates: ['a photo of a {}.']\n")
    write_cls_shard(tmp_path / "z-0.tar", [0, 1, 2, 7, 1])
    class_list = zeroshot.load_class_list(str(classes))
    source = labelled.ShardSource([str(tmp_path / "z-0.tar")], class_list.classnames, class_list.json_label,
                                  "--zeroshot-data")
    problems = labelled.Problems()
    assert [label for _, label in source.items(0, 1, problems)] == [0, 1, 2, 1]
    assert problems.count == 1 and ".cls 7 is outside 0..2" in problems.first[0]

    args = eval_args(zeroshot_classes=str(classes), zeroshot_data=str(tmp_path / "z-0.tar"))
    metrics = zeroshot.make_zero_shot(args, tiny_task().trainable_module, World(), torch.device("cpu"))(
        tiny_task(), 1, nullcontext)
    assert metrics["three-zeroshot-val-top5"] == 1.0  # three classes: the label is always among the top 3
    assert "skipped 1 samples" in caplog.text

    write_cls_shard(tmp_path / "bad-0.tar", [9, 9])
    args = eval_args(zeroshot_classes=str(classes), zeroshot_data=str(tmp_path / "bad-0.tar"))
    with pytest.raises(UsageError, match="no usable labelled images"):
        zeroshot.make_zero_shot(args, tiny_task().trainable_module, World(), torch.device("cpu"))(
            tiny_task(), 1, nullcontext)


def test_due_follows_upstream():
    assert [e for e in range(8) if zeroshot.due(e, 2, 7)] == [0, 2, 4, 6, 7]
    assert not any(zeroshot.due(e, 0, 7) for e in range(8))


@pytest.mark.parametrize("extra,message", [
    (["--zeroshot-data", "x.tar"], "--zeroshot-data needs --zeroshot-classes"),
    (["--zeroshot-classes", "demo-shapes"], "needs labelled images"),
    (["--zeroshot-classes", "no-such-list"], "built-in class lists are demo-shapes"),
    (["--zeroshot-frequency", "-1"], "--zeroshot-frequency must be an integer >= 0"),
    (["--val-frequency", "-2"], "--val-frequency must be an integer >= 0"),
])
def test_bad_zero_shot_flags(extra, message):
    from naflex_accum.train.params import parse_args

    with pytest.raises(UsageError, match=message):
        parse_args(["--train-data", "x.tar", *extra])


def test_run_logs_zero_shot_like_open_clip(shards, tmp_path):
    """Console line and tensorboard: val/shapes-zeroshot-val-top1 at epochs 0, 2 and the last (3)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from naflex_accum.train.main import train

    result = train(["--train-data", shards.train, "--val-data", shards.val, "--naflex-seq-lens", "16",
                    "--naflex-max-tokens-per-batch", "256", "--naflex-batch-divisor", "1", "--train-num-samples",
                    "32", "--epochs", "3", "--workers", "0", "--device", "cpu", "--logs", str(tmp_path),
                    "--name", "zs", "--val-at-start", "--val-seq-len", "16", "--zeroshot-classes", "demo-shapes",
                    "--zeroshot-frequency", "2", "--val-frequency", "3", "--report-to", "tensorboard"])
    zero_shot = {"shapes-zeroshot-val-top1", "shapes-zeroshot-val-top5"}
    assert [epoch for epoch, m in result["evals"] if zero_shot <= m.keys()] == [0, 2, 3]
    assert "image_to_text_R@1" in result["evals"][0][1] and "image_to_text_R@1" not in result["evals"][1][1]
    log = (tmp_path / "zs" / "out.log").read_text()
    assert "Eval Epoch: 2 shapes-zeroshot-val-top1: " in log
    events = EventAccumulator(str(tmp_path / "zs" / "tensorboard"))
    events.Reload()
    assert len(events.Scalars("val/shapes-zeroshot-val-top5")) == 3


def test_demo_summary_prints_before_and_after(capsys):
    from naflex_accum.commands.demo import summarize

    metrics = {"image_to_text_R@1": 0.01, "image_to_text_R@5": 0.05, "text_to_image_R@1": 0.02,
               "text_to_image_R@5": 0.06, "shapes-zeroshot-val-top1": 0.04, "shapes-zeroshot-val-top5": 0.2}
    after = {k: v * 10 for k, v in metrics.items()}
    summarize({"is_master": True, "first_loss": 5.5, "epoch_losses": [2.0], "val_samples": 1000,
               "evals": [(0, metrics), (5, after)]})
    out = capsys.readouterr().out
    assert "before (epoch 0)" in out and "after (epoch 5)" in out
    assert "zero-shot top-1 / top-5" in out and "0.040 / 0.200" in out and "0.400 / 2.000" in out
    assert "chance: R@1 0.0010; zero-shot over 30 colour-shape classes 0.033 / 0.167" in out
