"""A drop-in for upstream open_clip's ``_train_step_eager`` with one loss scale per window.

Invariant: for a full accumulation window, the gradient of every parameter
right before the optimizer step equals ``window_scale * d(L_window)/d(theta)``,
the gradient of one full-batch backward of the window's contrastive loss,
whatever the split: the scale is computed once from all cached sizes, the
logit parameters (``logit_scale``, ``logit_bias``) take their gradient in one
replay only, and each replay draws the same random masks as its caching pass.

Signature and return contract match upstream (see ../shared/UPSTREAM_CONTRACT.md):
``None`` while a window fills, else ``(losses, report, step_batch_size, ([], {}))``.
``AccumulationStep`` exposes small hooks (GradCache style) so variants, and the
reference bugs in the tests, override one decision each.
"""
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from .rng import RngState
from .scales import check_options, is_positive_int, window_is_naflex, window_loss_scale
from .sync import grad_sync

LOGIT_KEYS = ("logit_scale", "logit_bias")
# accum_features belongs to the step (upstream's loop only carries it between
# calls), so per-microbatch bookkeeping rides in it under a key no model emits.
WINDOW_KEY = "_naflex_accum_microbatches"


@dataclass
class Microbatch:
    size: int
    naflex: bool
    rng: RngState


@dataclass
class Window:
    microbatches: List[Microbatch]
    mode: str
    scale: float
    reference_batch_size: Optional[int] = None

    @property
    def sizes(self) -> List[int]:
        return [mb.size for mb in self.microbatches]


def is_naflex_batch(batch) -> bool:
    image = batch.get("image") if isinstance(batch, dict) else None
    return isinstance(image, dict) and "patches" in image


def total_loss(losses: Dict[str, torch.Tensor]) -> torch.Tensor:
    return sum(v for k, v in losses.items() if k.endswith("_loss"))


def backward(loss: torch.Tensor, scaler) -> None:
    if scaler is not None:
        scaler.scale(loss).backward()
    else:
        loss.backward()


def finish_step(task, optimizer, scaler, args) -> None:
    """Clip (after unscaling), step, update the scaler, clamp the logit scale."""
    clip = getattr(args, "grad_clip_norm", None)
    params = task.trainable_module.parameters
    if scaler is not None:
        if clip is not None:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(params(), clip, norm_type=2.0)
        scaler.step(optimizer)
        scaler.update()
    else:
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params(), clip, norm_type=2.0)
        optimizer.step()
    task.clamp_logit_scale()


def detach_values(d: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    return {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in d.items()}


def _accum_freq(args) -> int:
    k = getattr(args, "accum_freq", 1)
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"--accum-freq must be a positive integer; got {k!r}.")
    return k


def _microbatch_size(task, batch, position: int) -> int:
    size = task.batch_size(batch)
    if not is_positive_int(size):
        raise ValueError(
            f"the microbatch at position {position} of the window has size {size!r}; "
            f"every microbatch needs at least one sample.")
    return size


class AccumulationStep:
    """Callable with upstream's ``_train_step_eager`` signature."""

    # ---- hooks -----------------------------------------------------------
    def replay_scale(self, window: Window, j: int) -> float:
        """Loss multiplier of replay ``j``: the window's one scale, for every j."""
        return window.scale

    def logit_inputs(self, model_out: dict, j: int, k: int) -> dict:
        """The logit parameters for replay ``j``: live in the last replay only.

        Every replay computes the whole window's loss, so a live logit scale in
        each would count its gradient k times. The last replay is the synced
        one, so under DDP every parameter takes part in that backward.
        """
        live = j == k - 1
        return {key: (model_out[key] if live else model_out[key].detach())
                for key in LOGIT_KEYS if key in model_out}

    def replay_rng(self, microbatch: Microbatch):
        """Context for replay forwards: the random state of the microbatch's caching pass."""
        return microbatch.rng.replay()

    # ---- call ------------------------------------------------------------
    def __call__(self, task, batch, accum_state, optimizer, scaler, autocast, args):
        k = _accum_freq(args)
        if k == 1:
            return self.single_step(task, batch, accum_state, optimizer, scaler, autocast, args)
        if accum_state is None:
            raise ValueError("--accum-freq > 1 needs accum_state=([], {}) from the training loop; got None.")
        accum_batches, accum_features = accum_state
        records = accum_features.setdefault(WINDOW_KEY, [])
        records.append(self.admit(task, batch, records, args))
        self.cache(task, batch, accum_features, autocast)
        accum_batches.append(batch)
        if len(accum_batches) < k:
            return None

        window = self.make_window(accum_features.pop(WINDOW_KEY), args)
        optimizer.zero_grad()
        losses, report = self.backward_window(task, window, accum_batches, accum_features, scaler, autocast)
        finish_step(task, optimizer, scaler, args)
        return losses, report, sum(window.sizes), ([], {})

    def admit(self, task, batch, records: List[Microbatch], args) -> Microbatch:
        """Check a microbatch before its forward; capture its random state."""
        naflex = is_naflex_batch(batch)
        flags = [r.naflex for r in records] + [naflex]
        window_is_naflex(flags)
        if not records:
            check_options(getattr(args, "naflex_loss_scale", "none"), getattr(args, "batch_size", None), naflex)
        size = _microbatch_size(task, batch, len(records))
        return Microbatch(size=size, naflex=naflex, rng=RngState.capture(batch))

    def cache(self, task, batch, accum_features, autocast) -> None:
        """Features of one microbatch without grad (its random state is already captured)."""
        with torch.no_grad(), autocast():
            model_out = task.trainable_module(**batch)
        for key, value in model_out.items():
            if key not in LOGIT_KEYS:
                accum_features.setdefault(key, []).append(value)

    def make_window(self, records: List[Microbatch], args) -> Window:
        ref = getattr(args, "batch_size", None)
        mode = check_options(getattr(args, "naflex_loss_scale", "none"), ref, records[0].naflex)
        scale = window_loss_scale([r.size for r in records], ref, mode, naflex=[r.naflex for r in records])
        return Window(records, mode, scale, ref)

    def backward_window(self, task, window, accum_batches, accum_features, scaler, autocast):
        """Replay each microbatch with grad against the cached features of the others."""
        k = len(accum_batches)
        module = task.trainable_module
        for j, (batch_j, mb) in enumerate(zip(accum_batches, window.microbatches)):
            with grad_sync(module, j == k - 1):
                with self.replay_rng(mb), autocast():
                    model_out = module(**batch_j)
                with autocast():
                    inputs_no_accum = self.logit_inputs(model_out, j, k)
                    inputs = {
                        key: torch.cat(cached[:j] + [model_out[key]] + cached[j + 1:])
                        for key, cached in accum_features.items()
                    }
                    losses, report = task.compute_accum_loss(inputs, inputs_no_accum, accum_batches)
                    loss = total_loss(losses)
                    losses["loss"] = loss
                del inputs, inputs_no_accum, model_out
                scale = self.replay_scale(window, j)
                backward(loss * scale if scale != 1.0 else loss, scaler)
        return detach_values(losses), detach_values(report)

    def single_step(self, task, batch, accum_state, optimizer, scaler, autocast, args):
        """accum_freq == 1: one forward/backward, scaled by this batch's own scale."""
        naflex = is_naflex_batch(batch)
        mode = check_options(getattr(args, "naflex_loss_scale", "none"), getattr(args, "batch_size", None), naflex)
        size = _microbatch_size(task, batch, 0)
        scale = window_loss_scale([size], getattr(args, "batch_size", None), mode, naflex=naflex)
        optimizer.zero_grad()
        with autocast():
            losses, report = task(batch)
            loss = losses["loss"]
        backward(loss * scale if scale != 1.0 else loss, scaler)
        finish_step(task, optimizer, scaler, args)
        return detach_values(losses), detach_values(report), size, accum_state


_DEFAULT_STEP = AccumulationStep()


def train_step_eager(task, batch, accum_state, optimizer, scaler, autocast, args):
    """Drop-in for ``open_clip_train.train._train_step_eager`` (same signature and returns)."""
    return _DEFAULT_STEP(task, batch, accum_state, optimizer, scaler, autocast, args)
