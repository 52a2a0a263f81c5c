"""The upstream bugs, written as small overrides of our step, so tests can be seen to fail.

- PerReplayScaleStep: open_clip #1211, each replay scaled by its own size.
- LogitKTimesStep: every replay takes the live logit parameters, so their
  gradient is counted once per replay (k times).
- NoRngReplayStep: replays draw fresh random masks instead of the cached ones.
- UpstreamStyleStep: all three, as upstream open_clip main behaves today.
"""
import math
from contextlib import nullcontext

from naflex_accum.step import LOGIT_KEYS, AccumulationStep


class PerReplayScaleStep(AccumulationStep):
    def replay_scale(self, window, j):
        if window.mode == "none" or not window.microbatches[j].naflex:
            return 1.0
        ratio = window.microbatches[j].size / window.reference_batch_size
        return math.sqrt(ratio) if window.mode == "sqrt" else ratio


class LogitKTimesStep(AccumulationStep):
    def logit_inputs(self, model_out, j, k):
        return {key: model_out[key] for key in LOGIT_KEYS if key in model_out}


class NoRngReplayStep(AccumulationStep):
    def replay_rng(self, microbatch):
        return nullcontext()


class UpstreamStyleStep(PerReplayScaleStep, LogitKTimesStep, NoRngReplayStep):
    pass


per_replay_scale_step = PerReplayScaleStep()
logit_k_times_step = LogitKTimesStep()
no_rng_replay_step = NoRngReplayStep()
upstream_style_step = UpstreamStyleStep()
