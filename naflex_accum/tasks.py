"""CLIP, SigLIP and CoCa training tasks that speak upstream open_clip's task protocol.

Invariant: ``task(batch)`` and ``task.compute_accum_loss(...)`` compute one loss function, so a replayed window
and one full-batch forward see one objective.
"""
import math
from typing import Dict, Optional, Tuple

import torch
import torch.nn as nn
from open_clip.loss import ClipLoss, CoCaLoss, SigLipLoss

from .accum.step import total_loss
from .accum.window import is_naflex_batch, unwrap
from .data.patches import normalize_patches


def _report(source: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    return {key: source[key] for key in ("logit_scale", "logit_bias") if key in source}


class ContrastiveTask(nn.Module):
    """A model plus its contrastive loss; subclasses choose the loss."""

    data_keys = ("image", "text")
    image_stats: Optional[Tuple] = None  # (mean, std) uint8 NaFlex patches are normalised with; None: open_clip's

    def __init__(self, model: nn.Module, loss: nn.Module):
        super().__init__()
        self.trainable_module = model
        self.loss = loss

    def forward(self, batch: Dict) -> Tuple[Dict, Dict]:
        model_out = self.trainable_module(image=batch["image"], text=batch["text"])
        losses = self.loss(**model_out, output_dict=True)
        losses["loss"] = total_loss(losses)
        return losses, _report(model_out)

    def compute_accum_loss(self, inputs, inputs_no_accum, accum_batches):
        losses = self.loss(**inputs, **inputs_no_accum, output_dict=True)
        return losses, _report(inputs_no_accum)

    def batch_size(self, batch: Dict) -> int:
        image = batch["image"]
        if isinstance(image, dict):
            return image["patches"].shape[0]
        return image.shape[0]

    def clamp_logit_scale(self, max_val: float = math.log(100)) -> None:
        model = unwrap(self.trainable_module)
        with torch.no_grad():
            model.logit_scale.clamp_(0, max_val)

    def prepare_batch(self, batch: Dict, device, input_dtype: Optional[torch.dtype] = None) -> Dict:
        """Move tensors to ``device`` (floats as ``input_dtype``); uint8 NaFlex patches are normalised there, after
        the move: a quarter of the bytes cross, and the loader's CPUs skip the float pass."""
        out = {}
        for key, value in batch.items():
            if isinstance(value, dict):
                out[key] = self.prepare_batch(value, device, input_dtype)
            elif isinstance(value, torch.Tensor):
                dtype = input_dtype if value.is_floating_point() else None
                out[key] = value.to(device=device, dtype=dtype, non_blocking=True)
            else:
                out[key] = value
        if is_naflex_batch(out) and out["image"]["patches"].dtype == torch.uint8:
            out["image"] = normalize_patches(out["image"], *(self.image_stats or ()), dtype=input_dtype)
        return out


class ClipTask(ContrastiveTask):
    def __init__(self, model, *, local_loss=False, gather_with_grad=False, rank=0, world_size=1):
        super().__init__(model, ClipLoss(
            local_loss=local_loss, gather_with_grad=gather_with_grad, cache_labels=True,
            rank=rank, world_size=world_size))


class SigLipTask(ContrastiveTask):
    def __init__(self, model, *, rank=0, world_size=1, **_ignored):
        super().__init__(model, SigLipLoss(rank=rank, world_size=world_size))


class CocaTask(ContrastiveTask):
    """open_clip's CoCa with ``CoCaLoss``, as upstream main's ``CoCaTask``: both paths shift for teacher forcing,
    and ``compute_accum_loss`` does it upstream's way (adds ``labels``, slices ``logits``, pops ``logit_bias``)."""

    def __init__(self, model, *, caption_loss_weight=2.0, clip_loss_weight=1.0, local_loss=False,
                 gather_with_grad=False, rank=0, world_size=1):
        super().__init__(model, CoCaLoss(
            caption_loss_weight=caption_loss_weight, clip_loss_weight=clip_loss_weight, local_loss=local_loss,
            gather_with_grad=gather_with_grad, cache_labels=True, rank=rank, world_size=world_size))

    def forward(self, batch: Dict) -> Tuple[Dict, Dict]:
        model_out = self.trainable_module(image=batch["image"], text=batch["text"])
        losses = self.loss(image_features=model_out["image_features"], text_features=model_out["text_features"],
                           logits=model_out["logits"][:, :-1], labels=batch["text"][:, 1:],
                           logit_scale=model_out["logit_scale"], output_dict=True)
        losses["loss"] = total_loss(losses)
        return losses, _report(model_out)

    def compute_accum_loss(self, inputs, inputs_no_accum, accum_batches):
        inputs["labels"] = torch.cat([b["text"] for b in accum_batches])[:, 1:]
        inputs["logits"] = inputs["logits"][:, :-1]
        report = _report(inputs_no_accum)
        inputs_no_accum.pop("logit_bias", None)
        losses = self.loss(**inputs, **inputs_no_accum, output_dict=True)
        return losses, report


TASKS = {"clip": ClipTask, "siglip": SigLipTask, "coca": CocaTask}


def create_task(model, siglip: bool = False, *, loss: Optional[str] = None, **loss_kwargs) -> ContrastiveTask:
    """The task for ``model``: ``loss`` one of TASKS ('clip', 'siglip', 'coca'), else SigLIP if ``siglip``."""
    return TASKS[loss or ("siglip" if siglip else "clip")](model, **loss_kwargs)
