"""Accumulation that computes the window loss once (the GradCache method, Gao et al. 2021).

Invariant: the same as ``step.AccumulationStep`` (every parameter's gradient
equals ``window_scale * grad(full-batch loss)``, logit parameters counted
once), reached with one loss evaluation per window instead of k: the cached
features become leaves, the loss and its gradients with respect to them (and to
the logit values) are computed once, then each microbatch is re-run with grad
under its replayed random state and back-propagates its slice of that feature
gradient through a surrogate dot product. The logit terms ride on the last,
synced replay, so under DDP every parameter takes part in that backward.
"""
from typing import Dict, List

import torch

from .step import LOGIT_KEYS, AccumulationStep, Microbatch, detach_values, total_loss
from .sync import grad_sync

LOGIT_VALUES_KEY = "_naflex_accum_logit_values"


class CachedLossStep(AccumulationStep):
    """Upstream's ``_train_step_eager`` signature; one loss evaluation per window."""

    def cache(self, task, batch, accum_features, autocast) -> None:
        with torch.no_grad(), autocast():
            model_out = task.trainable_module(**batch)
        for key, value in model_out.items():
            if key in LOGIT_KEYS:
                # Parameters, identical for every microbatch: keep the latest values.
                accum_features.setdefault(LOGIT_VALUES_KEY, {})[key] = value
            else:
                accum_features.setdefault(key, []).append(value)

    def window_loss(self, task, window, accum_batches, accum_features, scaler, autocast):
        """Loss over the cached features, and its gradients with respect to features and logit values."""
        logit_values = accum_features.pop(LOGIT_VALUES_KEY, {})
        leaves = {key: torch.cat(cached).detach().requires_grad_() for key, cached in accum_features.items()}
        logits = {key: value.detach().requires_grad_() for key, value in logit_values.items()}
        with autocast():
            losses, report = task.compute_accum_loss(leaves, logits, accum_batches)
            loss = total_loss(losses)
            losses["loss"] = loss
        scaled = loss * window.scale if window.scale != 1.0 else loss
        if scaler is not None:
            scaled = scaler.scale(scaled)
        inputs = list(leaves.values()) + list(logits.values())
        grads = torch.autograd.grad(scaled, inputs, allow_unused=True)
        feature_grads = dict(zip(leaves, grads[: len(leaves)]))
        logit_grads = dict(zip(logits, grads[len(leaves):]))
        return losses, report, feature_grads, logit_grads

    def backward_window(self, task, window, accum_batches, accum_features, scaler, autocast):
        losses, report, feature_grads, logit_grads = self.window_loss(
            task, window, accum_batches, accum_features, scaler, autocast)
        k, module, offset = len(accum_batches), task.trainable_module, 0
        for j, (batch_j, mb) in enumerate(zip(accum_batches, window.microbatches)):
            last = j == k - 1
            with grad_sync(module, last):
                with self.replay_rng(mb), autocast():
                    model_out = module(**batch_j)
                surrogate = self.surrogate(model_out, feature_grads, offset, mb, logit_grads if last else {})
                surrogate.backward()
            offset += mb.size
        return detach_values(losses), detach_values(report)

    @staticmethod
    def surrogate(model_out: Dict, feature_grads: Dict, offset: int, mb: Microbatch, logit_grads: Dict):
        """A scalar whose gradient w.r.t. the parameters is the window loss's, through this microbatch."""
        terms: List[torch.Tensor] = []
        for key, grad in feature_grads.items():
            if grad is not None:
                terms.append((model_out[key] * grad[offset: offset + mb.size]).sum())
        for key, grad in logit_grads.items():
            if grad is not None:
                terms.append((model_out[key] * grad).sum())
        return torch.stack([t.float() for t in terms]).sum()


_CACHED_LOSS_STEP = CachedLossStep()


def cached_loss_step(task, batch, accum_state, optimizer, scaler, autocast, args):
    """Drop-in for ``open_clip_train.train._train_step_eager`` computing the window loss once."""
    return _CACHED_LOSS_STEP(task, batch, accum_state, optimizer, scaler, autocast, args)
