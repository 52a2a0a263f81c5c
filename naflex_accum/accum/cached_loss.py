"""The default mode: the window loss computed once per window (the GradCache method, Gao et al. 2021).

Invariant: the same as ``step.AccumulationStep``'s (every parameter's gradient
equals ``window_scale * grad(full-batch loss)``, logit parameters counted
once), reached with one loss evaluation per window instead of k. Each key's
cached outputs are concatenated once into a leaf of the step's own; the task's
``compute_accum_loss`` gets its own copies of the inputs dicts (it may read,
add, replace or drop entries, as upstream's CoCaTask does) and only the
step's floating-point leaves and logit values are differentiated. Each leaf's
gradient is split by that key's recorded per-microbatch lengths, and each
microbatch back-propagates its slices through its live outputs (its replay,
or for the last one the graph of its caching forward), times ``replay_scale``;
the logit values ``logit_inputs`` gives each backward take their gradient there
(a zero one except in the final backward).
"""
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from .step import AccumulationStep


@dataclass
class CachedLossState:
    feature_grads: Dict[str, List[torch.Tensor]]  # key -> one gradient slice per microbatch
    logit_grads: Dict[str, torch.Tensor]
    factors: List[float]  # what each microbatch's slices are still to be multiplied by
    result: Tuple[Any, Any, Any]  # (losses, report, the generation the task spoke)


def _uniform(values: List[float]) -> Optional[float]:
    return values[0] if all(v == values[0] for v in values) else None


class CachedLossStep(AccumulationStep):
    """Upstream's ``_train_step_eager`` signature; one loss evaluation per window."""

    def prepare(self, task, window, cache, accum_batches, scaler, autocast):
        """The window loss over the cached outputs, and its gradients with respect to them and the logit values."""
        inputs = cache.concatenated()
        leaves = {key: value.requires_grad_() for key, value in inputs.items() if value.is_floating_point()}
        logits = {key: value.detach().requires_grad_() for key, value in cache.logits.items()}
        lengths = {key: cache.lengths(key) for key in leaves}
        cache.features.clear()  # the concatenations hold the values now
        with autocast():
            losses, report, spoken = self.accum_loss(task, dict(inputs), dict(logits), list(accum_batches))
            loss = losses["loss"]
        del inputs
        factors = [self.replay_scale(window, j) for j in range(len(accum_batches))]
        common = _uniform(factors)
        scaled = loss * common if common not in (None, 1.0) else loss  # the usual case: fold the scale in once
        if scaler is not None:
            scaled = scaler.scale(scaled)
        targets = [*leaves.values(), *logits.values()]
        if scaled.requires_grad:
            grads = torch.autograd.grad(scaled, targets, allow_unused=True)
        else:  # a loss that depends on no cached output: nothing to back-propagate
            grads = [None] * len(targets)
        feature_grads = {key: g.split(lengths[key]) for key, g in zip(leaves, grads) if g is not None}
        logit_grads = {key: g for key, g in zip(logits, grads[len(leaves):]) if g is not None}
        return CachedLossState(feature_grads, logit_grads, [1.0] * len(factors) if common is not None else factors,
                               (losses, report, spoken))

    def backward_microbatch(self, task, window, state, j, model_out, final, scaler, autocast):
        factor = state.factors[j]
        outputs, grads = [], []
        for key, slices in state.feature_grads.items():
            out = model_out[key]
            if out.requires_grad:
                outputs.append(out)
                grads.append(slices[j] if factor == 1.0 else slices[j] * factor)
        for key, value in self.logit_inputs(model_out, j, final).items():
            grad = state.logit_grads.get(key)
            if value.requires_grad and grad is not None:
                outputs.append(value)
                grads.append(grad if factor == 1.0 else grad * factor)
        if outputs:
            torch.autograd.backward(outputs, grads)


_CACHED_LOSS_STEP = CachedLossStep()


def cached_loss_step(task, batch, accum_state, optimizer, scaler, autocast, args):
    """Drop-in for ``open_clip_train.train._train_step_eager`` (the default mode: the window loss once per window)."""
    return _CACHED_LOSS_STEP(task, batch, accum_state, optimizer, scaler, autocast, args)
