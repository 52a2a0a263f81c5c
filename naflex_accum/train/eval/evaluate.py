"""Held-out retrieval: image-to-text and text-to-image recall@1/5 and the contrastive loss.

Invariant: eval mode under no_grad on the unwrapped model (no DDP hooks, no collectives, eager even when
compiled), every held-out sample once, train mode after; open_clip's metric keys and order.
"""
from typing import Dict

import torch
import torch.nn.functional as F
from open_clip_train.train import get_clip_metrics

from ...tasks import unwrap


def retrieval_metrics(image_features, text_features, logit_scale) -> Dict[str, float]:
    """open_clip's ``get_clip_metrics`` (ranks, R@1/5/10), plus its ``clip_val_loss``."""
    metrics = {k: float(v) for k, v in get_clip_metrics(image_features, text_features, logit_scale).items()}
    logits, truth = logit_scale * image_features @ text_features.t(), torch.arange(len(image_features))
    metrics["clip_val_loss"] = ((F.cross_entropy(logits, truth) + F.cross_entropy(logits.t(), truth)) / 2).item()
    return metrics


@torch.no_grad()
def evaluate(task, val_loader, device, autocast, epoch: int) -> Dict[str, float]:
    model = unwrap(task.trainable_module)
    was_training = model.training
    model.eval()
    images, texts, scale = [], [], None
    try:
        for batch in val_loader:
            batch = task.prepare_batch(batch, device)
            with autocast(), torch.compiler.set_stance("force_eager"):
                out = model(image=batch["image"], text=batch["text"])
            images.append(out["image_features"].float().cpu())
            texts.append(out["text_features"].float().cpu())
            scale = out["logit_scale"].float().cpu()
    finally:
        model.train(was_training)
    if not images:
        return {}
    metrics = retrieval_metrics(torch.cat(images), torch.cat(texts), scale)
    metrics.update(epoch=epoch, num_samples=sum(len(x) for x in images))
    return metrics
