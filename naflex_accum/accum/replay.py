"""The replay mode: the window loss recomputed for every microbatch, as upstream open_clip does it.

Invariant: ``step.AccumulationStep``'s: microbatch j's backward is the whole window's loss with j's outputs
live and the others' cached, times ``replay_scale``; the last microbatch uses its caching forward's graph.
"""
from dataclasses import dataclass, field
from typing import Any, Tuple

from .step import AccumulationStep, backward
from .window import WindowCache


@dataclass
class ReplayState:
    cache: WindowCache
    accum_batches: list
    result: Tuple[Any, Any, Any] = field(default=(None, None, None))  # (losses, report, generation)


class ReplayStep(AccumulationStep):
    """Upstream's ``_train_step_eager`` signature; the window loss once per microbatch."""

    def prepare(self, task, window, cache, accum_batches, scaler, autocast):
        return ReplayState(cache, accum_batches)

    def backward_microbatch(self, task, window, state, j, model_out, final, scaler, autocast):
        with autocast():
            inputs = state.cache.with_live(j, model_out)
            inputs_no_accum = self.logit_inputs(model_out, j, final)
            losses, report, spoken = self.accum_loss(task, inputs, inputs_no_accum, state.accum_batches)
            loss = losses["loss"]
        del inputs, inputs_no_accum
        scale = self.replay_scale(window, j)
        backward(loss * scale if scale != 1.0 else loss, scaler)
        state.result = losses, report, spoken


_REPLAY_STEP = ReplayStep()


def replay_step(task, batch, accum_state, optimizer, scaler, autocast, args):
    """Drop-in for ``open_clip_train.train._train_step_eager`` in the replay mode (the window loss per microbatch)."""
    return _REPLAY_STEP(task, batch, accum_state, optimizer, scaler, autocast, args)
