"""Fine-tuning flags of ``naflex-accum train``, with open_clip's names: pretrained weights, locking, and the rest.

Invariants: ``--pretrained`` loads every tensor with its exact shape or stops with one line naming the first
keys that do not fit; a locked parameter has ``requires_grad=False`` before the optimizer and DDP are built;
``--resume`` wins over ``--pretrained``, as upstream. docs/training.md, "Fine-tuning" and "Locking towers".
"""
import argparse
import logging
import os
from typing import Dict, List

import torch
from timm.models import clean_state_dict, group_parameters
from timm.models.naflexvit import checkpoint_filter_fn

from ...data import DataConfig
from ...errors import UsageError, check_ints
from ..config import upstream_flags
from ..eval import zeroshot
from ..kept.checkpoint import load_payload

log = logging.getLogger(__name__)
SHOWN_KEYS = 3  # keys named in a mismatch message, per kind


def add_args(parser: argparse.ArgumentParser) -> None:
    """The fine-tuning, zero-shot and data flags, then every other upstream flag (refused with its reason)."""
    f = parser.add_argument_group("fine-tuning (open_clip's flags)")
    f.add_argument("--pretrained", default=None, metavar="FILE",
                   help="local weights: an open_clip checkpoint, a run's epoch_K.pt, or timm NaFlexVit/ViT image-tower "
                        "weights (.pt/.pth/.bin/.safetensors); --resume wins over it; none or '': random init")
    f.add_argument("--lock-image", action="store_true", help="freeze the image tower (projection included)")
    f.add_argument("--lock-image-unlocked-groups", type=int, default=0, metavar="N",
                   help="with --lock-image: leave the top N layer groups trainable (the projection is the first)")
    f.add_argument("--lock-image-freeze-bn-stats", action="store_true", help="no effect: NaFlexVit has no BatchNorm")
    f.add_argument("--lock-text", action="store_true", help="freeze the text tower (projection included)")
    f.add_argument("--lock-text-unlocked-layers", type=int, default=0, metavar="N",
                   help="with --lock-text: leave the top N layer groups trainable (the projection is the first)")
    f.add_argument("--lock-text-freeze-layer-norm", action="store_true",
                   help="no effect: LayerNorm keeps no running statistics")
    f.add_argument("--text-pooler-own-group", dest="text_pooler_in_head", action="store_false",
                   help="no effect: open_clip's text tower has no readout pooler")
    f.add_argument("--force-patch-dropout", type=float, default=None, metavar="P",
                   help="override the image tower's patch dropout (0 turns it off) (default: the model config's)")
    f.add_argument("--grad-checkpointing", action="store_true",
                   help="activation checkpointing in both towers (model.set_grad_checkpointing)")
    f.add_argument("--use-bn-sync", action="store_true", help="no effect: the models have no BatchNorm")
    f.add_argument("--use-naflex", action="store_true", help="no effect: NaFlex batching is always on here")
    f.add_argument("--force-naflex-vision", action="store_true", help="no effect: the image tower is a NaFlexVit")
    d = parser.add_argument_group("data sampling (open_clip's flags)")
    d.add_argument("--dataset-resampled", action=argparse.BooleanOptionalAction,
                   default=DataConfig.dataset_resampled, help="draw training shards with replacement")
    d.add_argument("--train-data-upsampling-factors", default=None, metavar="F1::F2",
                   help="with --dataset-resampled: relative weight of each '::'-joined --train-data source, "
                        "e.g. 1::2")
    zeroshot.add_args(parser)
    upstream_flags.register(parser)
    parser.epilog = ("Other open_clip flags are refused with the reason (the table against upstream is in "
                     "docs/training.md).")


def validate(args) -> None:
    """Check the flags added here (after the trainer's own checks)."""
    upstream_flags.check_namespace(args)
    if args.force_patch_dropout is not None and not 0.0 <= args.force_patch_dropout < 1.0:
        raise UsageError(f"--force-patch-dropout must be in [0, 1); got {args.force_patch_dropout}")
    check_ints(args, 0, "lock_image_unlocked_groups", "lock_text_unlocked_layers", "zeroshot_frequency",
               "val_frequency")
    for count, lock in (("--lock-image-unlocked-groups", "lock_image"), ("--lock-text-unlocked-layers", "lock_text")):
        if getattr(args, count[2:].replace("-", "_")) and not getattr(args, lock):
            raise UsageError(f"{count} has no effect without --{lock.replace('_', '-')}")
    if args.lock_image and args.lock_text and not args.lock_image_unlocked_groups \
            and not args.lock_text_unlocked_layers:
        raise UsageError("--lock-image and --lock-text with no unlocked groups leave only logit_scale to train; "
                         "unlock some layers (--lock-image-unlocked-groups/--lock-text-unlocked-layers)")
    zeroshot.validate(args)



def read_state_dict(path: str) -> Dict[str, torch.Tensor]:
    """A state_dict from a local file, read by the safe reader: raw, or under state_dict/model keys, without
    DDP's ``module.`` prefix (timm's ``clean_state_dict``)."""
    if not os.path.isfile(path):
        raise UsageError(f"--pretrained {path}: no such file; give a local weights file (pretrained tags such as "
                         f"'laion2b_s34b_b79k' need a download, which this trainer does not do)")
    payload = load_payload(path, flag="--pretrained")
    state_dict = next((payload[k] for k in ("state_dict", "model") if isinstance(payload.get(k), dict)), payload)
    if not state_dict or not all(isinstance(v, torch.Tensor) for v in state_dict.values()):
        raise UsageError(f"--pretrained {path}: holds no state_dict of tensors")
    return clean_state_dict(state_dict)


def mismatch(model_sd: Dict, file_sd: Dict) -> str:
    """'' when ``file_sd`` has exactly the keys and shapes of ``model_sd``; else what differs, first keys first."""
    missing = [k for k in model_sd if k not in file_sd]
    unexpected = [k for k in file_sd if k not in model_sd]
    shapes = [f"{k}: file {list(file_sd[k].shape)} vs model {list(v.shape)}"
              for k, v in model_sd.items() if k in file_sd and file_sd[k].shape != v.shape]
    parts = []
    for what, keys in (("missing", missing), ("unexpected", unexpected), ("with another shape", shapes)):
        if keys:
            more = ", ..." if len(keys) > SHOWN_KEYS else ""
            parts.append(f"{len(keys)} {what} ({', '.join(keys[:SHOWN_KEYS])}{more})")
    return "; ".join(parts)


def _is_open_clip(state_dict: Dict) -> bool:
    return "logit_scale" in state_dict or any(k.startswith(("visual.", "token_embedding.")) for k in state_dict)


def _timm_tower_weights(trunk, state_dict: Dict) -> Dict:
    """timm ViT/NaFlexVit weights in the trunk's layout, without a classifier head the trunk lacks."""

    trunk_keys = trunk.state_dict().keys()
    state_dict = {k: v for k, v in state_dict.items() if not (k.startswith("head.") and k not in trunk_keys)}
    return checkpoint_filter_fn(state_dict, trunk)


def load_pretrained(model, path: str, model_name: str = "the model") -> str:
    """Load ``path`` into ``model`` (all of it, or its image tower for timm weights); returns what was loaded."""
    state_dict = read_state_dict(path)
    if _is_open_clip(state_dict):
        target, what = model, "open_clip model"
    else:
        target, what = model.visual.trunk, "image tower (timm NaFlexVit)"
        state_dict = _timm_tower_weights(target, state_dict)
    problem = mismatch(target.state_dict(), state_dict)
    if problem:
        raise UsageError(f"--pretrained {path} does not fit the {what} of --model {model_name}: {problem}")
    target.load_state_dict(state_dict, strict=True)
    return f"{what}, {len(state_dict)} tensors"



def image_layer_groups(visual) -> List[List[torch.nn.Parameter]]:
    """The image tower's parameters in layer groups, input side first: timm's own groups, then the projection."""

    trunk = visual.trunk
    grouped = group_parameters(trunk, trunk.group_matcher())
    groups = [[trunk.get_parameter(name) for name in grouped[i]] for i in sorted(grouped)]
    head = list(visual.head.parameters())
    return groups + ([head] if head else [])


def lock_image_tower(model, unlocked_groups: int = 0) -> None:
    """Upstream main's ``TimmModel.lock``: freeze all but the top ``unlocked_groups`` groups, projection included
    (3.3.0's keeps the projection trainable and counts only trunk groups)."""
    groups = image_layer_groups(model.visual)
    if unlocked_groups >= len(groups):
        raise UsageError(f"--lock-image-unlocked-groups {unlocked_groups} unlocks all {len(groups)} layer groups "
                         f"of the image tower; use at most {len(groups) - 1}, or drop --lock-image")
    for i, group in enumerate(groups):
        for p in group:
            p.requires_grad_(i >= len(groups) - unlocked_groups)


def lock_text_tower(model, unlocked_layers: int = 0) -> None:
    """open_clip 3.3.0's ``lock_text_tower`` (the same groups as upstream main: embeddings, blocks, projection)."""
    groups = 1 + len(model.transformer.resblocks) + (model.text_projection is not None)  # embeddings, blocks, proj
    if unlocked_layers >= groups:
        raise UsageError(f"--lock-text-unlocked-layers {unlocked_layers} unlocks all {groups} layer groups of the "
                         f"text tower; use at most {groups - 1}, or drop --lock-text")
    model.lock_text_tower(unlocked_layers=unlocked_layers)


def prepare_model(model, args) -> None:
    """``--pretrained``, then the locks, then ``--grad-checkpointing``; before DDP and the optimizer."""
    if args.pretrained:
        loaded = load_pretrained(model, args.pretrained, args.model)
        log.info(f"Loaded --pretrained {args.pretrained} ({loaded})")
    if args.lock_image:
        lock_image_tower(model, args.lock_image_unlocked_groups)
    if args.lock_text:
        lock_text_tower(model, args.lock_text_unlocked_layers)
    if args.lock_image or args.lock_text:
        total = sum(p.numel() for p in model.parameters())
        frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
        log.info(f"Locked {frozen:,} of {total:,} parameters; {total - frozen:,} train")
    if args.grad_checkpointing:
        model.set_grad_checkpointing(True)
