"""Zero-shot classification during training: class lists, labelled shards and folders, metrics, frequency, demo."""

from contextlib import nullcontext

import pytest
import torch
from unit.train.test_zeroshot import eval_args, tiny_task  # noqa: F401 (fixtures)

from naflex_accum.data import labelled
from naflex_accum.errors import UsageError
from naflex_accum.train.eval import zeroshot
from naflex_accum.train.ending.distributed import World


def imagenet_folder(root, names, filled):
    from naflex_accum.data.demo import render_sample

    for i, name in enumerate(names):
        (root / name).mkdir(parents=True)
        if i in filled:
            data, ext, _ = render_sample(0, "inet", i)
            (root / name / f"img.{ext}").write_bytes(data)


def test_imagenet_val_and_v2_folders(tmp_path, monkeypatch):
    monkeypatch.setattr(zeroshot, "OPENAI_IMAGENET_TEMPLATES", ("a photo of a {}.",))  # 1 template, not 80: fast
    synsets = [f"n{i:08d}" for i in range(1000)]
    imagenet_folder(tmp_path / "val", synsets, {3, 500, 501, 998})
    imagenet_folder(tmp_path / "v2" / labelled.IMAGENET_V2_SUBFOLDER, [str(i) for i in range(1000)], {10, 999})
    # 4 images: the val set is read by 2 loader workers, v2's 2 images in the main process
    args = eval_args(imagenet_val=str(tmp_path / "val"), imagenet_v2=str(tmp_path / "v2"), workers=2)
    sets = zeroshot.image_sets(args)
    assert [label for _, label in sets[0].source.files] == [3, 500, 501, 998]
    assert [label for _, label in sets[1].source.files] == [10, 999]  # by folder name, not string order
    metrics = zeroshot.make_zero_shot(args, tiny_task().trainable_module, World(), torch.device("cpu"))(
        tiny_task(), 1, nullcontext)
    assert set(metrics) == {"imagenet-zeroshot-val-top1", "imagenet-zeroshot-val-top5",
                            "imagenetv2-zeroshot-val-top1", "imagenetv2-zeroshot-val-top5"}
    with pytest.raises(UsageError, match="expected 1000 class subfolders"):
        zeroshot.image_sets(eval_args(imagenet_val=str(tmp_path / "v2")))
