"""What the loop learns about its steps without waiting for the device, and the checks that read it.

Invariants: between two checks the loop never reads the device; a check is one all-reduce and one read on
every rank at the same step, so all take the same decision; a non-finite loss is seen before any checkpoint
is written after it. docs/long-runs.md, "Checks and device reads".
"""
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Dict, List

import torch

NONE_BAD = 2 ** 62  # "no non-finite step yet" in the device-side first-bad-step record
REPORT_KEYS = ("logit_scale", "logit_bias")


class NonFiniteLoss(Exception):
    def __init__(self, global_step: int):
        super().__init__(f"non-finite loss at optimizer step {global_step}")
        self.global_step = global_step


@contextmanager
def host_read():
    """The step's one deliberate device-to-host read (allowed under ``torch.cuda.set_sync_debug_mode``)."""
    if not torch.cuda.is_available():
        yield
        return
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(mode)


@dataclass
class Check:
    """The outcome of a check, the same on every rank."""
    stop: bool
    steps: int
    info: Dict = field(default_factory=dict)  # for RunLogger.step (empty when no step ran since the last)


class StepMonitor:
    def __init__(self, device, world):
        self.device, self.world = device, world
        self.keys: List[str] = []  # loss terms, in the order of the first step's dict
        self.first_bad = torch.full((), NONE_BAD, dtype=torch.int64, device=device)
        self._reset()

    def _reset(self):
        self.sums, self.last, self.report, self.report_keys = None, None, [], []
        self.steps, self.samples, self.tokens, self.data_time = 0, 0, 0, 0.0
        self.since = time.time()

    def add(self, global_step: int, losses: Dict, report: Dict, samples: int, tokens: int, data_time: float):
        """One optimizer step: device operations only."""
        if not self.keys:
            self.keys = list(losses)
        last = torch.stack([losses[k].detach().float().mean() for k in self.keys]).double()
        self.sums = last * samples if self.sums is None else self.sums + last * samples
        self.last = last
        self.report_keys = [k for k in REPORT_KEYS if k in report]
        self.report = [report[k].detach().float().mean().double() for k in self.report_keys]
        bad = ~torch.isfinite(losses["loss"].detach()).all()
        self.first_bad = torch.minimum(self.first_bad, torch.where(bad, global_step, NONE_BAD))
        self.steps += 1
        self.samples += samples
        self.tokens += tokens
        self.data_time += data_time

    def check(self, stop_requested: bool) -> Check:
        """One packed all-reduce and one read: the stop vote, the non-finite guard and the steps' numbers."""
        with host_read():
            host = torch.tensor([float(self.tokens), float(stop_requested)], dtype=torch.float64)
            parts = [host.to(self.device, non_blocking=True), (self.first_bad != NONE_BAD).double().reshape(1)]
            if self.steps:
                parts = [self.last, self.sums, *[r.reshape(1) for r in self.report]] + parts
            values = self.world.sum_(torch.cat(parts)).tolist()
            if values[-1] > 0:
                raise NonFiniteLoss(self.world.min_int(int(self.first_bad)))
        outcome = Check(stop=values[-2] > 0, steps=self.steps)
        if self.steps:
            outcome.info = self._info(values)
        self._reset()
        return outcome

    def _info(self, values: List[float]) -> Dict:
        n, world = len(self.keys), self.world.world_size
        report = dict(zip(self.report_keys, values[2 * n: -3]))
        return {
            "losses": {k: v / world for k, v in zip(self.keys, values[:n])},
            "loss_sums": {k: v / world for k, v in zip(self.keys, values[n: 2 * n])},
            "logit_scale": report.get("logit_scale", float("nan")) / world,
            "logit_bias": report["logit_bias"] / world if "logit_bias" in report else None,
            "tokens_global": values[-3], "samples": self.samples, "samples_global": self.samples * world,
            "steps": self.steps, "elapsed": time.time() - self.since, "data_time": self.data_time / self.steps,
        }

