"""A task whose ``compute_accum_loss`` reads, adds, replaces and drops entries of the dicts it is given.

Invariant: ``task(batch)`` and ``compute_accum_loss`` compute one objective, with outputs of other shapes
(``pair_features``: two rows a sample; integer ``text_lengths``), so a step that differentiates the dicts it
passed, or slices gradients by microbatch size, fails on it. ``make_mutating_task`` is an ``audit_case`` factory.
"""
from typing import Dict, Optional

import torch
import torch.nn as nn

from ..accum.step import total_loss
from ..models import create_model
from ..tasks import ClipTask, _report, unwrap


class ExtraOutputs(nn.Module):
    """A CLIP model whose output dict also holds ``pair_features`` [2B, D] and ``text_lengths`` (int64 [B])."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, image, text):
        out = dict(self.model(image=image, text=text))
        out["pair_features"] = torch.cat([out["image_features"], out["text_features"]])
        out["text_lengths"] = (text != 0).sum(1)
        return out


def _objective(loss_fn, image, text, pair, weights, logit_scale, logit_bias: Optional[torch.Tensor]):
    losses = loss_fn(image_features=image, text_features=text, logit_scale=logit_scale, output_dict=True)
    # Row order of ``pair`` differs between a full batch and a window: use it only through a mean over rows.
    losses["pair_loss"] = 0.1 * pair.square().sum(-1).mean()
    losses["weighted_loss"] = 0.1 * (weights * (image * text).sum(-1)).mean()
    if logit_bias is not None:
        losses["bias_loss"] = 0.01 * logit_bias.square().sum()
    return losses


class MutatingTask(ClipTask):
    def __init__(self, model: nn.Module, **loss_kwargs):
        super().__init__(ExtraOutputs(model), **loss_kwargs)

    def forward(self, batch: Dict):
        out = self.trainable_module(image=batch["image"], text=batch["text"])
        weights = out["text_lengths"].float() / batch["text"].shape[1]
        losses = _objective(self.loss, out["image_features"], out["text_features"], out["pair_features"][:, 1:],
                            weights, out["logit_scale"], out.get("logit_bias"))
        losses["loss"] = total_loss(losses)
        return losses, _report(out)

    def compute_accum_loss(self, inputs, inputs_no_accum, accum_batches):
        context = accum_batches[0]["text"].shape[1]
        inputs["pair_features"] = inputs["pair_features"][:, 1:]  # replaced by a slice (a view of the step's leaf)
        inputs["weights"] = inputs.pop("text_lengths").float() / context  # dropped; a float entry added
        inputs["labels"] = torch.arange(inputs["image_features"].shape[0])  # an integer entry added
        inputs_no_accum["logit_scale"] = inputs_no_accum["logit_scale"].clamp(max=100.0)  # replaced
        logit_bias = inputs_no_accum.pop("logit_bias", None)  # dropped, used apart
        report = _report({**inputs_no_accum, **({"logit_bias": logit_bias} if logit_bias is not None else {})})
        losses = _objective(self.loss, inputs["image_features"], inputs["text_features"], inputs["pair_features"],
                            inputs["weights"], inputs_no_accum["logit_scale"], logit_bias)
        return losses, report

    def clamp_logit_scale(self, max_val: float = 4.6052) -> None:
        with torch.no_grad():
            unwrap(self.trainable_module).model.logit_scale.clamp_(0, max_val)


def make_mutating_task(loss: str, stochastic: bool) -> MutatingTask:
    """``audit_case``'s ``make_task``: the built-in tiny NaFlex CLIP (SigLIP: with a logit bias) in a MutatingTask."""
    torch.manual_seed(0)
    extra = dict(patch_dropout=0.5, drop_path=0.1, text_dropout=0.1) if stochastic else {}
    return MutatingTask(create_model("naflex-tiny", siglip=(loss == "siglip"), **extra))
