"""The accumulation step both modes share: upstream's ``_train_step_eager`` contract, one loss scale per window.

Invariant: for a full window, each parameter's gradient before the optimizer step is ``window_scale`` times
one full-batch backward's, whatever the split: one scale from all sizes, the logit parameters' gradient in one
backward (a zero one in the others, so FSDP2 and DDP see every parameter in every backward), replays under
their caching pass's random state. The last microbatch's caching forward keeps its graph and goes first; the
last replay carries the sync. Misuse (a closed, mixed or two-model window) is refused before the forward; a
failed forward leaves the window as it was. Contract, order of work and the hooks (``replay_scale``,
``logit_inputs``, ``replay_rng``, ``grad_sync``): docs/api.md, "The steps".
"""
from typing import Dict, List, Optional

import torch

from ..errors import StepError, is_positive_int
from .contract import Contract, task_result
from .rng import RngState
from .scales import check_options, window_is_naflex, window_loss_scale
from .sync import grad_sync
from .window import (LOGIT_KEYS, SPENT, STEPPED, WINDOW_KEY, Microbatch, Window, WindowCache, is_naflex_batch,
                     microbatch_size, window_cache)

__all__ = ["AccumulationStep", "LOGIT_KEYS", "Microbatch", "Window", "WINDOW_KEY", "backward", "detach_values",
           "finish_step", "is_naflex_batch", "total_loss"]


class _ZeroGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, value):
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad):
        return torch.zeros_like(grad)


def zero_gradient(value: torch.Tensor) -> torch.Tensor:
    """``value`` itself in the forward, a zero gradient back to its parameter: a backward reaches the parameter
    and adds nothing to its gradient (a detached value would leave it out)."""
    return _ZeroGradient.apply(value) if value.requires_grad else value


def total_loss(losses: Dict[str, torch.Tensor]) -> torch.Tensor:
    return sum(v for k, v in losses.items() if k.endswith("_loss"))


def backward(loss: torch.Tensor, scaler) -> None:
    if scaler is not None:
        scaler.scale(loss).backward()
    else:
        loss.backward()


def finish_step(task, optimizer, scaler, args) -> None:
    """Clip (after unscaling), step, update the scaler, clamp the logit scale: upstream's order."""
    clip = getattr(args, "grad_clip_norm", None)
    params = task.trainable_module.parameters
    if scaler is not None:
        if clip is not None:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(params(), clip, norm_type=2.0)
        scaler.step(optimizer)  # skips the optimizer when a gradient is inf/nan
        scaler.update()  # and then backs the scale off
    else:
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params(), clip, norm_type=2.0)
        optimizer.step()
    task.clamp_logit_scale()


def detach_values(d: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    return {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in d.items()}


def _accum_freq(args) -> int:
    k = getattr(args, "accum_freq", 1)
    if not is_positive_int(k):
        raise StepError(f"--accum-freq must be a positive integer; got {k!r}.")
    return k


class AccumulationStep:
    """Callable with upstream's ``_train_step_eager`` signature; a mode supplies the window's backward:
    ``prepare(...) -> state`` once all outputs are cached, ``backward_microbatch(...)`` once per microbatch."""

    def __init__(self, contract: Optional[Contract] = None):
        self.contract = contract  # None: answer in whichever generation the task speaks
        self.calls = self.steps = 0  # how often it was called, and made an optimizer step (diagnostics)
        self.window_scale: Optional[float] = None  # the loss scale of the last step made

    # ---- hooks -----------------------------------------------------------
    def replay_scale(self, window: Window, j: int) -> float:
        """Multiplier of microbatch ``j``'s gradient: the window's one scale, for every j."""
        return window.scale

    def logit_inputs(self, model_out: dict, j: int, final: bool) -> dict:
        """The logit values microbatch ``j``'s backward sees: taking gradient in the final one only; the others
        pass them through ``zero_gradient``, so every backward still reaches the logit parameters (FSDP2)."""
        return {key: (model_out[key] if final else zero_gradient(model_out[key]))
                for key in LOGIT_KEYS if key in model_out}

    def replay_rng(self, microbatch: Microbatch):
        """Context for replay forwards: the random state of the microbatch's caching pass."""
        return microbatch.rng.replay()

    def grad_sync(self, module, enabled: bool):
        """Context in which backward passes all-reduce gradients only if ``enabled``."""
        return grad_sync(module, enabled)

    # ---- the task contract ---------------------------------------------------
    def run_task(self, task, batch):
        """``task(batch)`` as ``(losses, report, generation)``."""
        return task_result(task(batch), f"{type(task).__name__}(batch)", self.contract)

    def accum_loss(self, task, inputs, inputs_no_accum, accum_batches):
        """``task.compute_accum_loss`` as ``(losses, report, generation)``, ``losses["loss"]`` the window's total."""
        logits = dict(inputs_no_accum)  # before the task may drop entries (CoCa drops logit_bias)
        losses, report, spoken = task_result(task.compute_accum_loss(inputs, inputs_no_accum, accum_batches),
                                             f"{type(task).__name__}.compute_accum_loss", self.contract, logits)
        losses["loss"] = total_loss(losses)
        return losses, report, spoken

    # ---- call ------------------------------------------------------------
    def __call__(self, task, batch, accum_state, optimizer, scaler, autocast, args):
        self.calls += 1
        k = _accum_freq(args)
        if k == 1:
            return self.single_step(task, batch, accum_state, optimizer, scaler, autocast, args)
        if accum_state is None:
            raise StepError("--accum-freq > 1 needs accum_state=([], {}) from the training loop; got None.")
        cache = window_cache(accum_state)  # refuses a closed or mixed state
        accum_batches, accum_features = accum_state
        cache.take(self.admit(task, batch, cache, args), batch)
        accum_batches.append(batch)
        try:
            if len(accum_batches) < k:
                self.cache(task, batch, cache, autocast)
                return None
            window = self.make_window(cache.microbatches, args)
            optimizer.zero_grad()
            losses, report, spoken = self.backward_window(task, window, cache, accum_batches, scaler, autocast)
            finish_step(task, optimizer, scaler, args)
        except BaseException:
            if cache.added < len(accum_batches):  # its forward failed, so no backward ran: undo this microbatch
                cache.forget_last()
                accum_batches.pop()
            else:  # the window's backward had begun: its gradients are partial, its cached outputs may be spent
                accum_features[WINDOW_KEY] = SPENT
            raise
        accum_features[WINDOW_KEY] = STEPPED
        self.window_scale = window.scale
        self.steps += 1
        return spoken.step_result(losses, report, sum(window.sizes), ([], {}))

    def admit(self, task, batch, cache: WindowCache, args) -> Microbatch:
        """Check a microbatch before its forward (model, kind and size); capture its random state."""
        cache.check_model(task.trainable_module)
        records = cache.microbatches
        naflex = is_naflex_batch(batch)
        window_is_naflex([r.naflex for r in records] + [naflex])
        if not records:
            check_options(getattr(args, "naflex_loss_scale", "none"), getattr(args, "batch_size", None), naflex)
        size = microbatch_size(task, batch, len(records))
        return Microbatch(size=size, naflex=naflex, rng=RngState.capture(batch))

    def cache(self, task, batch, cache: WindowCache, autocast) -> None:
        """Outputs of one microbatch without grad (its random state is already captured)."""
        with torch.no_grad(), autocast():
            model_out = task.trainable_module(**batch)
        cache.add(model_out)

    def make_window(self, records: List[Microbatch], args) -> Window:
        ref = getattr(args, "batch_size", None)
        mode = check_options(getattr(args, "naflex_loss_scale", "none"), ref, records[0].naflex)
        scale = window_loss_scale([r.size for r in records], ref, mode, naflex=[r.naflex for r in records])
        return Window(records, mode, scale, ref)

    def backward_window(self, task, window, cache, accum_batches, scaler, autocast):
        """Every microbatch's backward, the final one synced and carrying the logit terms: the last one's caching
        forward runs with grad and serves as its replay, then the others are replayed."""
        k, module = len(accum_batches), task.trainable_module
        with self.grad_sync(module, False):
            with autocast():
                model_out = module(**accum_batches[-1])
            cache.add(model_out)
            state = self.prepare(task, window, cache, accum_batches, scaler, autocast)
            self.backward_microbatch(task, window, state, k - 1, model_out, False, scaler, autocast)
        del model_out
        self.replay(task, window, state, accum_batches, range(k - 1), scaler, autocast)
        losses, report, spoken = state.result
        return detach_values(losses), detach_values(report), spoken

    def replay(self, task, window, state, accum_batches, replayed, scaler, autocast) -> None:
        """Replay ``replayed`` in order, each under its caching random state; the last backward syncs."""
        module, replayed = task.trainable_module, list(replayed)
        for j in replayed:
            final = j == replayed[-1]
            with self.grad_sync(module, final):
                with self.replay_rng(window.microbatches[j]), autocast():
                    model_out = module(**accum_batches[j])
                self.backward_microbatch(task, window, state, j, model_out, final, scaler, autocast)
            del model_out

    def prepare(self, task, window, cache, accum_batches, scaler, autocast):
        raise NotImplementedError

    def backward_microbatch(self, task, window, state, j, model_out, final, scaler, autocast):
        raise NotImplementedError

    def single_step(self, task, batch, accum_state, optimizer, scaler, autocast, args):
        """accum_freq == 1: one forward/backward, scaled by this batch's own scale."""
        naflex = is_naflex_batch(batch)
        mode = check_options(getattr(args, "naflex_loss_scale", "none"), getattr(args, "batch_size", None), naflex)
        size = microbatch_size(task, batch, 0)
        scale = window_loss_scale([size], getattr(args, "batch_size", None), mode, naflex=naflex)
        self.window_scale = scale
        optimizer.zero_grad()
        with autocast():
            losses, report, spoken = self.run_task(task, batch)
            loss = losses["loss"]
        backward(loss * scale if scale != 1.0 else loss, scaler)
        finish_step(task, optimizer, scaler, args)
        self.steps += 1
        return spoken.step_result(detach_values(losses), detach_values(report), size, accum_state)

