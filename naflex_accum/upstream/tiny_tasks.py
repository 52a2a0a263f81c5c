"""Tiny random CLIP, SigLIP and CoCa tasks built by upstream open_clip main's own factory and task classes.

Invariant: the model comes from upstream's ``open_clip.create_model`` as its trainer builds one (NaFlex for CLIP
and SigLIP; dense for CoCa, whose pooling needs tokens NaFlex refuses) in upstream's task class, seeded; nothing
is built until called, and open_clip 3.3.0 (no ``open_clip.task``) is reported unavailable.
"""
import contextlib
import copy
import json
import logging
import math
import os
import tempfile
from typing import Dict

import open_clip
import torch

from ..models import fill_decoder_projection

LOSSES = ("clip", "siglip", "coca")
TASK_CLASSES = {"clip": "CLIPTask", "siglip": "SigLIPTask", "coca": "CoCaTask"}

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

# Upstream's CoCa layout (coca_ViT-B-32: attentional pooling, image and text
# tokens, a multimodal decoder) at width 32, depth 2, 32 px images of 2x2 patches.
# The audit draws its tokens from a 1,024-word vocabulary (the caption loss's
# cost grows with it); a trainer run needs the tokenizer's 49,408.
COCA_CONTEXT_LENGTH = 16
COCA_IMAGE_SIZE = 32
AUDIT_VOCAB_SIZE = 1024
TOKENIZER_VOCAB_SIZE = 49408


def _tiny_coca(vocab_size: int) -> Dict:
    text = {"context_length": COCA_CONTEXT_LENGTH, "vocab_size": vocab_size, "width": 32, "heads": 2, "layers": 2}
    return {
        "embed_dim": 32,
        "vision_cfg": {"image_size": COCA_IMAGE_SIZE, "layers": 2, "width": 32, "head_width": 16,
                       "patch_size": 16, "attentional_pool": True, "attn_pooler_queries": 4,
                       "attn_pooler_heads": 2, "output_tokens": True},
        "text_cfg": {**text, "embed_cls": True, "output_tokens": True},
        "multimodal_cfg": {**text, "attn_pooler_heads": 2},
        "custom_text": True,
    }


COCA_STOCHASTIC = {"patch_dropout": 0.5}
STOCHASTIC_NOTE = {
    "clip": "patch dropout 0.5 and drop path 0.1 in the image tower",
    "siglip": "patch dropout 0.5 and drop path 0.1 in the image tower",
    "coca": "patch dropout 0.5 in the image tower",
}
DESCRIPTION = {
    "clip": "upstream open_clip CLIPTask around a tiny random NaFlex model from open_clip.create_model "
            "(force_naflex_vision)",
    "siglip": "upstream open_clip SigLIPTask around a tiny random NaFlex model from open_clip.create_model "
              "(force_naflex_vision)",
    "coca": "upstream open_clip CoCaTask around a tiny random CoCa (dense 32 px images) from "
            "open_clip.create_model",
}


def available() -> bool:
    """Whether upstream main's task classes are importable (open_clip 4.x dev)."""
    try:
        import open_clip.task as tasks  # upstream main's alone (open_clip_torch 3.3.0 has none)
    except ImportError:
        return False
    return all(hasattr(tasks, name) for name in TASK_CLASSES.values())


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


def model_config(loss: str, stochastic: bool = False, vocab_size: int = TOKENIZER_VOCAB_SIZE) -> Dict:
    """The tiny model's open_clip config (``model_cfg``) for ``loss``; ``vocab_size`` is CoCa's."""
    if loss == "coca":
        cfg = _tiny_coca(vocab_size)
        if stochastic:
            cfg["vision_cfg"].update(COCA_STOCHASTIC)
        return cfg
    cfg = copy.deepcopy(TINY_CONFIG)
    if stochastic:
        cfg["vision_cfg"].update(STOCHASTIC)
    return cfg


def write_model_dir(folder: str, loss: str, stochastic: bool = False,
                    vocab_size: int = TOKENIZER_VOCAB_SIZE, weights: bool = False) -> str:
    """Write ``folder/open_clip_config.json`` for ``loss``; the ``local-dir:`` model name (upstream picks its CoCa
    task when it contains "coca"). ``weights`` saves the seeded model's (a CoCa run needs them)."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "open_clip_config.json"), "w") as f:
        json.dump({"model_cfg": model_config(loss, stochastic, vocab_size)}, f)
    name = f"local-dir:{folder}"
    if weights:
        torch.manual_seed(0)
        torch.save(_build(name, loss).state_dict(), os.path.join(folder, "open_clip_pytorch_model.bin"))
    return name


def _build(name: str, loss: str, **extra):
    with _quiet("open_clip"):
        model = open_clip.create_model(name, output_dict=True, device="cpu", **extra)
    if loss == "coca":
        fill_decoder_projection(model)
    return model


def create_model(loss: str, stochastic: bool):
    # SigLIP's initial logit scale and bias, as upstream's main passes them for --siglip.
    extra = {"init_logit_scale": math.log(10), "init_logit_bias": -10.0} if loss == "siglip" else {}
    if loss != "coca":
        extra["force_naflex_vision"] = True
    with tempfile.TemporaryDirectory(prefix="naflex-accum-verify-") as folder:
        return _build(write_model_dir(folder, loss, stochastic, vocab_size=AUDIT_VOCAB_SIZE), loss, **extra)


def task_factory(loss: str, stochastic: bool):
    """``audit_case``'s ``make_task`` for upstream: (loss, stochastic) -> a seeded upstream task."""
    import open_clip.task as tasks  # upstream main's alone (open_clip_torch 3.3.0 has none)

    torch.manual_seed(0)
    return getattr(tasks, TASK_CLASSES[loss])(create_model(loss, stochastic))


def describe(loss: str) -> str:
    return DESCRIPTION[loss]


def _audio_model(name: str) -> bool:
    """Whether upstream's config of model ``name`` has an audio tower (CLAP); hub names are not looked up."""
    if not name or name.startswith("hf-hub:"):
        return False
    try:
        return "audio_cfg" in (open_clip.get_model_config(name) or {})
    except Exception:  # an unknown name: upstream's main reports it
        return False


def run_kind(args):
    """``(kind, None)``: which tiny task ('clip', 'siglip', 'coca') stands for this run's; ``(None, why)`` if none."""
    model = str(getattr(args, "model", "") or "")
    if getattr(args, "distill", False) or getattr(args, "distill_model", None):  # main sets .distill later
        return None, "--distill-model trains DistillCLIPTask, which naflex-accum does not verify"
    if _audio_model(model):
        return None, f"--model {model} is an audio-text (CLAP) model, which naflex-accum does not verify"
    if "coca" in model.lower():
        return "coca", None
    for name, task in (("genlap", "GenLapTask"), ("genlip", "GenLipTask")):  # as upstream's create_task tells
        if name in model.lower():
            return None, f"--model {model} trains {task}, which naflex-accum does not verify"
    return ("siglip" if getattr(args, "siglip", False) else "clip"), None


def run_task_factory(args, kind: str):
    """``make_task(loss, stochastic)``: a seeded tiny model of ``kind`` in the task upstream's ``create_task``
    builds from this run's ``args`` (one process, rank 0: the tiny task gathers nothing)."""
    from open_clip import create_task  # upstream main's alone

    local = copy.copy(args)
    local.rank, local.world_size, local.distributed, local.distill = 0, 1, False, False

    def make_task(loss: str, stochastic: bool):
        torch.manual_seed(0)
        return create_task(local, model=create_model(kind, stochastic))
    return make_task
