"""Tiny random NaFlex CLIP/SigLIP tasks built by upstream open_clip main's own factory and task classes.

Invariant: the model comes from upstream's ``open_clip.create_model`` with
``force_naflex_vision=True``, as its trainer builds one under ``--use-naflex``,
and the task is upstream's ``CLIPTask``/``SigLIPTask``, so ``naflex-accum
verify`` audits a step on the objects that upstream training hands it. The
same seed gives the same weights on every call. Nothing is built or imported
until called; open_clip 3.3.0 (no ``open_clip.task``) is reported unavailable.
"""
import contextlib
import copy
import json
import logging
import math
import os
import tempfile

# A timm NaFlexVit shrunk through timm_model_kwargs (upstream passes them on to
# timm), with a text tower small enough for a CPU audit in seconds.
TINY_CONFIG = {
    "embed_dim": 32,
    "vision_cfg": {
        "image_size": 64,
        "image_seq_len": 16,
        "timm_model_name": "naflexvit_base_patch16_gap",
        "timm_model_pretrained": False,
        "timm_model_kwargs": {"embed_dim": 32, "depth": 2, "num_heads": 2, "reg_tokens": 1},
    },
    "text_cfg": {"context_length": 32, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2},
}
STOCHASTIC = {"patch_dropout": 0.5, "timm_drop_path": 0.1}
DESCRIPTION = ("upstream open_clip {cls} around a tiny random NaFlex model from open_clip.create_model "
               "(force_naflex_vision)")


def available() -> bool:
    """Whether upstream main's task classes are importable (open_clip 4.x dev)."""
    try:
        import open_clip.task as tasks
    except ImportError:
        return False
    return hasattr(tasks, "CLIPTask") and hasattr(tasks, "SigLIPTask")


@contextlib.contextmanager
def _quiet(logger_name: str):
    # A local-dir model without weights is what we want; upstream warns about it.
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def create_model(siglip: bool, stochastic: bool):
    import open_clip

    cfg = copy.deepcopy(TINY_CONFIG)
    if stochastic:
        cfg["vision_cfg"].update(STOCHASTIC)
    # SigLIP's initial logit scale and bias, as upstream's main passes them for --siglip.
    extra = {"init_logit_scale": math.log(10), "init_logit_bias": -10.0} if siglip else {}
    with tempfile.TemporaryDirectory(prefix="naflex-accum-verify-") as folder, _quiet("open_clip"):
        with open(os.path.join(folder, "open_clip_config.json"), "w") as f:
            json.dump({"model_cfg": cfg}, f)
        return open_clip.create_model(f"local-dir:{folder}", force_naflex_vision=True, output_dict=True,
                                      device="cpu", **extra)


def task_factory(loss: str, stochastic: bool):
    """``audit_case``'s ``make_task`` for upstream: (loss, stochastic) -> a seeded upstream task."""
    import torch
    from open_clip.task import CLIPTask, SigLIPTask

    torch.manual_seed(0)
    siglip = loss == "siglip"
    model = create_model(siglip, stochastic)
    return SigLIPTask(model) if siglip else CLIPTask(model)


def describe(loss: str) -> str:
    return DESCRIPTION.format(cls="SigLIPTask" if loss == "siglip" else "CLIPTask")
