"""Full-batch equivalence of the accumulated gradient, and the bugs that break it.

Every parameter's raw gradient right before the optimizer step must equal the
window scale times the gradient of one explicit full-batch backward (relative
error <= 1e-5), with logit_scale/logit_bias ratio 1.0.
"""
import pytest

from bug_reference import (logit_k_times_step, no_rng_replay_step, per_replay_scale_step,
                           upstream_style_step)
from naflex_accum.audit import AUDIT_SPLITS, audit_case
from naflex_accum.cached_loss import cached_loss_step
from naflex_accum.step import train_step_eager

ACCUM = {"replay": train_step_eager, "cached-loss": cached_loss_step}

MODES = ("none", "linear", "sqrt")
LOSSES = ("clip", "siglip")
UNEVEN = ((1, 2), (2, 1), (3, 5), (5, 3), (1, 2, 5), (5, 2, 1))


def assert_exact(r):
    assert r.tower_rel_err <= 1e-5, f"tower grad off by {r.tower_rel_err:.2e} at {r.worst_param}"
    for name, ratio in r.logit_ratios.items():
        assert ratio == pytest.approx(1.0, abs=1e-5), f"{name} gradient ratio {ratio}"
    assert r.loss_rel_err <= 1e-5
    assert r.step_batch_size == sum(r.split)
    assert r.passed


@pytest.mark.parametrize("split", AUDIT_SPLITS, ids=str)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("accum", ACCUM)
def test_full_batch_equivalence(make_task, accum, loss, mode, split):
    assert_exact(audit_case(ACCUM[accum], make_task, loss, mode, split))


@pytest.mark.parametrize("split", AUDIT_SPLITS, ids=str)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("accum", ACCUM)
def test_full_batch_equivalence_stochastic(make_task, accum, loss, mode, split):
    """Patch dropout 0.5 and drop path in the image tower, dropout in the text tower."""
    assert_exact(audit_case(ACCUM[accum], make_task, loss, mode, split, stochastic=True))


@pytest.mark.parametrize("loss", LOSSES)
def test_cached_loss_evaluates_the_loss_once_per_window(make_task, loss):
    calls = []

    def counted(loss_name, stochastic):
        task = make_task(loss_name, stochastic)
        real = task.compute_accum_loss
        task.compute_accum_loss = lambda *a: calls.append(1) or real(*a)
        return task
    assert_exact(audit_case(cached_loss_step, counted, loss, "linear", (1, 2, 5)))
    assert len(calls) == 1
    calls.clear()
    audit_case(train_step_eager, counted, loss, "linear", (1, 2, 5))
    assert len(calls) == 3  # replay: once per microbatch, as upstream


@pytest.mark.parametrize("split", UNEVEN, ids=str)
@pytest.mark.parametrize("mode", ("linear", "sqrt"))
@pytest.mark.parametrize("loss", LOSSES)
def test_per_replay_scale_bug_is_caught(make_task, loss, mode, split):
    r = audit_case(per_replay_scale_step, make_task, loss, mode, split)
    assert r.tower_rel_err > 1e-2 and not r.passed


@pytest.mark.parametrize("split", ((1, 2), (4, 4), (1, 2, 5)), ids=str)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("loss", LOSSES)
def test_logit_k_times_bug_is_caught(make_task, loss, mode, split):
    r = audit_case(logit_k_times_step, make_task, loss, mode, split)
    for ratio in r.logit_ratios.values():
        assert ratio == pytest.approx(len(split), rel=1e-4)
    assert not r.passed


@pytest.mark.parametrize("split", ((1, 2), (4, 4), (5, 2, 1)), ids=str)
@pytest.mark.parametrize("loss", LOSSES)
def test_unreplayed_rng_bug_is_caught(make_task, loss, split):
    r = audit_case(no_rng_replay_step, make_task, loss, "linear", split, stochastic=True)
    assert r.tower_rel_err > 1e-3 and not r.passed


@pytest.mark.parametrize("loss", LOSSES)
def test_upstream_style_step_fails_the_audit(make_task, loss):
    r = audit_case(upstream_style_step, make_task, loss, "linear", (2, 1))
    assert r.tower_rel_err > 0.1
    # linear: the per-replay scales sum to k times the window scale, so k = 2 here
    assert r.logit_ratios["logit_scale"] == pytest.approx(2.0, rel=1e-4)
    assert not r.passed
