"""Equivalence beyond CLIP/SigLIP: CoCa (dense images), a task that rewrites its inputs, and outputs refused.

Upstream's CoCaTask adds an integer ``labels`` entry to the inputs dict it is
given and replaces ``logits`` by a slice; a step that differentiates that dict,
or slices gradients by microbatch size, crashes or goes wrong. Both modes must
give the full-batch gradient on it and on ``MutatingTask`` (which also emits
an output with two rows per sample and an integer one).
"""
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
from pairwise import pairwise
from unit.accum.test_equivalence import ACCUM, LOSS_SCALES, assert_exact

from naflex_accum import cached_loss_step, replay_step
from naflex_accum.testing.mutating_task import make_mutating_task
from naflex_accum.upstream.audit import GradProbe, audit_case, default_task_factory, named_params, random_window

SPLITS = ((1, 2), (2, 1), (3, 5), (1, 2, 5), (5, 2, 1))


@pytest.mark.parametrize("accum,mode,split", pairwise(accum=tuple(ACCUM), mode=LOSS_SCALES, split=SPLITS))
def test_coca_equivalence(accum, mode, split):
    assert_exact(audit_case(ACCUM[accum], default_task_factory, "coca", mode, split))


@pytest.mark.parametrize("split", ((1, 2), (5, 2, 1)), ids=str)
@pytest.mark.parametrize("accum", ACCUM)
def test_coca_equivalence_stochastic(accum, split):
    """Patch dropout 0.5 in the image tower, attention dropout in the text tower and the decoder."""
    assert_exact(audit_case(ACCUM[accum], default_task_factory, "coca", "linear", split, stochastic=True))


@pytest.mark.parametrize("accum", ACCUM)
def test_coca_with_a_logit_bias_the_loss_drops(accum):
    """CoCaTask pops logit_bias from inputs_no_accum: it gets no gradient, and nothing breaks."""
    def make(loss, stochastic):
        return default_task_factory(loss, stochastic, logit_bias=True)
    r = audit_case(ACCUM[accum], make, "coca", "linear", (2, 1, 3))
    assert_exact(r)
    assert "logit_bias" not in r.logit_ratios  # zero in the reference, so compared as a tower parameter


@pytest.mark.parametrize("accum,loss,mode,split", pairwise(accum=tuple(ACCUM), loss=("clip", "siglip"),
                                                             mode=LOSS_SCALES, split=SPLITS))
def test_mutating_task_equivalence(accum, loss, mode, split):
    assert_exact(audit_case(ACCUM[accum], make_mutating_task, loss, mode, split))


@pytest.mark.parametrize("split", ((2, 1), (1, 2, 5)), ids=str)
@pytest.mark.parametrize("accum", ACCUM)
def test_mutating_task_equivalence_stochastic(accum, split):
    assert_exact(audit_case(ACCUM[accum], make_mutating_task, "siglip", "sqrt", split, stochastic=True))


class OddOutputs(torch.nn.Module):
    """The tiny CLIP plus one output that cannot be concatenated over a window."""

    def __init__(self, model, kind):
        super().__init__()
        self.module, self.kind, self.calls = model, kind, 0

    def forward(self, image, text):
        out = dict(self.module(image=image, text=text))
        self.calls += 1
        if self.kind == "scalar":
            out["aux"] = out["image_features"].sum()
        elif self.kind == "list":
            out["aux"] = [1, 2]
        elif self.kind == "width":
            out["aux"] = torch.zeros(text.shape[0], self.calls)
        elif self.kind == "missing" and self.calls == 2:
            del out["text_features"]
        return out


@pytest.mark.parametrize("kind,match", [
    ("scalar", r"model output 'aux' cannot be accumulated: microbatch 0 gave \[\] float32;"),
    ("list", r"model output 'aux' cannot be accumulated: microbatch 0 gave list;"),
    ("width", r"model output 'aux' cannot be accumulated: microbatch 0 gave \[1, 1\] float32, "
              r"microbatch 1 gave \[2, 2\] float32;"),
    ("missing", r"model output 'text_features' is missing from microbatch 1 of the window"),
])
@pytest.mark.parametrize("accum", ACCUM)
def test_outputs_that_cannot_be_concatenated_are_refused_in_one_line(accum, kind, match):
    task = default_task_factory("clip", False)
    task.trainable_module = OddOutputs(task.trainable_module, kind)
    probe = GradProbe(named_params(task))
    args = SimpleNamespace(accum_freq=3, batch_size=4, naflex_loss_scale="linear", grad_clip_norm=None)
    state = ([], {})
    with pytest.raises(ValueError, match=match) as info:
        for batch in random_window((1, 2, 1)):
            ACCUM[accum](task, batch, state, probe, None, nullcontext, args)
    assert "\n" not in str(info.value)
    assert probe.steps == 0 and all(p.grad is None for p in task.parameters())


def test_old_cached_loss_crash_is_what_this_guards(make_task):
    """The leaves are the step's own: the task adding an int entry no longer reaches autograd.grad."""
    calls = []

    def make(loss, stochastic):
        task = default_task_factory(loss, stochastic)
        real = task.compute_accum_loss

        def spy(inputs, inputs_no_accum, batches):
            calls.append((set(inputs), set(inputs_no_accum)))
            return real(inputs, inputs_no_accum, batches)
        task.compute_accum_loss = spy
        return task
    assert_exact(audit_case(cached_loss_step, make, "coca", "none", (2, 1)))
    assert_exact(audit_case(replay_step, make, "coca", "none", (2, 1)))
    # every call saw the model's outputs only: the previous call's additions never leak back
    assert all(keys == ({"image_features", "text_features", "logits"}, {"logit_scale"}) for keys in calls)
