"""The two contract generations, without upstream: the step speaks each one, and refuses what fits neither.

A task of the older generation (``losses`` alone, as upstream 5964c41's) is the
built-in task with its results converted the way that generation shaped them:
``task(batch)``'s losses carry ``logit_scale``, ``compute_accum_loss`` returns the
loss terms only. The real 5964c41 is covered by the upstream matrix tests.
"""
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

from naflex_accum.accum.cached_loss import CachedLossStep
from naflex_accum.accum.contract import LOSSES, REPORT, split_result, task_result
from naflex_accum.accum.replay import ReplayStep
from naflex_accum.errors import ContractError, StepError
from naflex_accum.upstream.audit import accumulated_grads, audit_case, random_window

STEPS = {"cached-loss": CachedLossStep, "replay": ReplayStep}


def losses_only(task):
    """``task`` (a report-generation task) speaking the older generation."""
    cls = type(task)

    class LossesOnly(cls):
        def forward(self, batch):
            losses, report = cls.forward(self, batch)
            return {**losses, "logit_scale": report["logit_scale"]}

        def compute_accum_loss(self, inputs, inputs_no_accum, accum_batches):
            return cls.compute_accum_loss(self, inputs, inputs_no_accum, accum_batches)[0]
    task.__class__ = LossesOnly
    return task


class Odd(torch.nn.Module):
    """A task whose results are of no known generation."""

    def __init__(self, task):
        super().__init__()
        self.inner = task
        self.trainable_module = task.trainable_module

    def forward(self, batch):
        return list(self.inner(batch))

    def compute_accum_loss(self, *args):
        return list(self.inner.compute_accum_loss(*args))

    def batch_size(self, batch):
        return self.inner.batch_size(batch)

    def clamp_logit_scale(self):
        self.inner.clamp_logit_scale()


def test_task_result_reads_each_generation_and_names_what_it_cannot():
    loss, scale = torch.tensor(1.0), torch.tensor(14.0)
    assert task_result(({"loss": loss}, {"logit_scale": scale}), "t", None)[2] is REPORT
    losses, report, spoken = task_result({"loss": loss, "logit_scale": scale}, "t", None)
    assert spoken is LOSSES and report == {"logit_scale": scale}
    losses, report, spoken = task_result({"contrastive_loss": loss}, "t", LOSSES, {"logit_bias": scale})
    assert report == {"logit_bias": scale}  # what the step passed in, as that generation's step reported it
    with pytest.raises(ContractError) as info:
        task_result({"loss": loss}, "CLIPTask.compute_accum_loss", REPORT)
    message = str(info.value)
    assert message.startswith("CLIPTask.compute_accum_loss returned a dict; expected a (losses, report) tuple of "
                              "dicts, the form of the contract \"report\"") and "\n" not in message
    with pytest.raises(ContractError, match=r"returned a list; expected \(losses, report\) \[upstream from "):
        task_result([loss], "t", None)
    assert isinstance(info.value, StepError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize("mode", STEPS)
@pytest.mark.parametrize("loss", ["clip", "siglip"])
@pytest.mark.parametrize("contract", [None, LOSSES], ids=["follows-the-task", "bound"])
def test_the_older_generation_is_exact_and_answers_in_its_form(make_task, mode, loss, contract):
    step = STEPS[mode](contract)
    result = audit_case(step, lambda l, s: losses_only(make_task(l, s)), loss, "linear", (2, 1), stochastic=True)
    assert result.passed, result
    task = losses_only(make_task(loss, False))
    window = random_window((2, 1))
    args = SimpleNamespace(accum_freq=2, batch_size=4, naflex_loss_scale="linear", grad_clip_norm=None)
    state, out = ([], {}), None
    for batch in window:
        out = step(task, batch, state, torch.optim.SGD(task.parameters(), lr=0.0), None, nullcontext, args)
    losses, n, accum_state = out  # three values, as upstream 5964c41's loop unpacks
    assert n == 3 and accum_state == ([], {}) and "logit_scale" in losses and "loss" in losses
    assert not losses["logit_scale"].requires_grad and split_result(out) == (losses, 3)


def test_a_bound_step_refuses_a_task_of_the_other_generation_in_one_line(make_task):
    task = losses_only(make_task("clip", False))
    step = CachedLossStep(REPORT)
    with pytest.raises(ContractError, match=r"LossesOnly\.compute_accum_loss returned a dict; expected a "
                                            r"\(losses, report\) tuple"):
        accumulated_grads(step, task, random_window((1, 2)), [0, 1],
                          SimpleNamespace(accum_freq=2, batch_size=4, naflex_loss_scale="none", grad_clip_norm=None))


@pytest.mark.parametrize("mode", STEPS)
def test_a_task_of_no_known_generation_is_refused_before_the_optimizer_steps(make_task, mode):
    task = Odd(make_task("clip", False))
    before = {k: v.clone() for k, v in task.trainable_module.state_dict().items()}
    with pytest.raises(ContractError, match="returned a list"):
        accumulated_grads(STEPS[mode](), task, random_window((1, 2)), [0, 1],
                          SimpleNamespace(accum_freq=2, batch_size=4, naflex_loss_scale="none", grad_clip_norm=None))
    assert all(torch.equal(before[k], v) for k, v in task.trainable_module.state_dict().items())
