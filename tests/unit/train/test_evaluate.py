"""Held-out retrieval: the numbers are open_clip's metrics of what the run's model computes, image by image, at
the patch size evaluation uses (the first of --naflex-patch-sizes), whatever the sizes."""
from contextlib import nullcontext

import pytest
import torch
from open_clip.tokenizer import SimpleTokenizer

from naflex_accum.data.decode import decode_for_seq
from naflex_accum.data.patches import collate_images
from naflex_accum.data.samples import tar_members
from naflex_accum.train.distributed import World
from naflex_accum.train.evaluate import evaluate, retrieval_metrics
from naflex_accum.train.main import build_data, build_task
from naflex_accum.train.params import parse_args


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from naflex_accum.data import write_demo_data
    return write_demo_data(tmp_path_factory.mktemp("ev") / "data", num_samples=32, val_samples=20, seed=0)


def one_by_one(model, val_url: str, patch_size: int, flatten: bool):
    """Image and text features of every held-out sample, each image encoded alone."""
    tokenizer = SimpleTokenizer(context_length=model.context_length)
    images, texts, files = [], [], {}
    for name, data in tar_members(val_url):
        files[name.rsplit(".", 1)[1]] = data
        if "txt" in files and ("jpg" in files or "png" in files):
            patches = collate_images([decode_for_seq(files.get("jpg") or files["png"], 16, patch_size)], 16,
                                     patch_size, flatten=flatten)
            images.append(model.encode_image(patches, normalize=True))
            texts.append(model.encode_text(tokenizer([files["txt"].decode()]), normalize=True))
            files = {}
    return torch.cat(images), torch.cat(texts)


@pytest.mark.parametrize("sizes", [[16], [8, 16], [16, 8]], ids=str)
def test_evaluation_is_the_models_own_at_the_first_patch_size(shards, sizes):
    args = parse_args(["--train-data", shards.train, "--val-data", shards.val, "--model", "naflex-tiny",
                       "--naflex-seq-lens", "16", "--naflex-max-tokens-per-batch", "256", "--naflex-batch-divisor", "1",
                       "--val-seq-len", "16", "--val-batch-size", "8", "--workers", "0",
                       "--naflex-patch-sizes", *map(str, sizes)])
    world, device = World(), torch.device("cpu")
    task, model = build_task(args, world, device)
    _, val = build_data(args, world, model, device)
    metrics = evaluate(task, val, device, nullcontext, epoch=1)
    assert model.training and metrics["num_samples"] == 20

    model.eval()
    with torch.no_grad():
        images, texts = one_by_one(model, shards.val.replace("{000000..000000}", "000000"), sizes[0],
                                   flatten=len(sizes) == 1)
        expected = retrieval_metrics(images, texts, model.logit_scale.exp())
    assert {k: metrics[k] for k in expected} == pytest.approx(expected, rel=1e-4, abs=1e-5)
