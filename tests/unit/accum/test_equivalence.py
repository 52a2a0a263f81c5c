"""Full-batch equivalence of the accumulated gradient, and the bugs that break it, in both modes.

Every parameter's raw gradient right before the optimizer step must equal the
window scale times the gradient of one explicit full-batch backward (relative
error <= 1e-5), with logit_scale/logit_bias ratio 1.0.
"""
import pytest
from pairwise import pairs_covered, pairwise

from naflex_accum import cached_loss_step, replay_step
from naflex_accum.testing.bugs import bug_step
from naflex_accum.testing.older_order import OlderCachedLossStep, OlderReplayStep
from naflex_accum.upstream.audit import AUDIT_SPLITS, audit_case, default_task_factory

ACCUM = {"replay": replay_step, "cached-loss": cached_loss_step}
STEP_MODES = tuple(ACCUM)

LOSS_SCALES = ("none", "linear", "sqrt")
LOSSES = ("clip", "siglip")
UNEVEN = ((1, 2), (2, 1), (3, 5), (5, 3), (1, 2, 5), (5, 2, 1))
# Every pair of step mode, loss, loss scale and split (tests/pairwise.py); the stochastic grid takes other
# combinations beyond the pairs than the plain one.
GRID = dict(accum=STEP_MODES, loss=LOSSES, mode=LOSS_SCALES, split=AUDIT_SPLITS)
EXACT, EXACT_STOCHASTIC = pairwise(**GRID), pairwise(shift=1, **GRID)
PER_REPLAY_GRID = dict(accum=STEP_MODES, loss=LOSSES, mode=("linear", "sqrt"), split=UNEVEN)
PER_REPLAY = pairwise(**PER_REPLAY_GRID)
LOGIT_K_GRID = dict(accum=STEP_MODES, loss=LOSSES, mode=LOSS_SCALES, split=((1, 2), (4, 4), (1, 2, 5)))
LOGIT_K_TIMES = pairwise(**LOGIT_K_GRID)
UNREPLAYED_GRID = dict(accum=STEP_MODES, loss=LOSSES, split=((1, 2), (4, 4), (5, 2, 1)))
UNREPLAYED = pairwise(**UNREPLAYED_GRID)


def test_the_grids_hold_every_pair():
    for cases, factors in ((EXACT, GRID), (EXACT_STOCHASTIC, GRID), (PER_REPLAY, PER_REPLAY_GRID),
                           (LOGIT_K_TIMES, LOGIT_K_GRID), (UNREPLAYED, UNREPLAYED_GRID)):
        assert pairs_covered(cases, **factors)


def assert_exact(r, tol=1e-5):
    assert r.tower_rel_err <= tol, f"tower grad off by {r.tower_rel_err:.2e} at {r.worst_param}"
    for name, ratio in r.logit_ratios.items():
        assert ratio == pytest.approx(1.0, abs=tol), f"{name} gradient ratio {ratio}"
    assert r.loss_rel_err <= tol
    assert r.step_batch_size == sum(r.split)
    assert r.passed


@pytest.mark.parametrize("accum,loss,mode,split", EXACT)
def test_full_batch_equivalence(make_task, accum, loss, mode, split):
    assert_exact(audit_case(ACCUM[accum], make_task, loss, mode, split))


@pytest.mark.parametrize("accum,loss,mode,split", EXACT_STOCHASTIC)
def test_full_batch_equivalence_stochastic(make_task, accum, loss, mode, split):
    """Patch dropout 0.5 and drop path in the image tower, dropout in the text tower."""
    assert_exact(audit_case(ACCUM[accum], make_task, loss, mode, split, stochastic=True))


@pytest.mark.parametrize("split", ((1, 2), (5, 2, 1)), ids=str)
@pytest.mark.parametrize("step", (OlderReplayStep(), OlderCachedLossStep()), ids=type)
def test_older_order_stays_exact(make_task, step, split):
    """The older order of work (``testing.older_order``: every microbatch replayed), which the benchmark
    compares against, is exact too."""
    assert_exact(audit_case(step, make_task, "siglip", "linear", split, stochastic=True))


def checkpointed_task(loss, stochastic):
    return default_task_factory(loss, stochastic, grad_checkpointing=True)


@pytest.mark.parametrize("accum,loss,split", pairwise(accum=STEP_MODES, loss=LOSSES, split=((1, 2), (3, 1, 4))))
def test_grad_checkpointing_equivalence(accum, loss, split):
    """``model.set_grad_checkpointing(True)`` (both towers recompute in backward), stochastic layers on."""
    assert_exact(audit_case(ACCUM[accum], checkpointed_task, loss, "linear", split, stochastic=True))


def test_grad_checkpointing_reaches_both_towers():
    """The switch is the model's own: timm NaFlexVit's blocks and open_clip's text blocks run twice per backward."""
    from naflex_accum.upstream.audit import random_window

    task = checkpointed_task("clip", True)
    model = task.trainable_module
    calls = {"image": 0, "text": 0}

    def count(tower):
        return lambda *a: calls.__setitem__(tower, calls[tower] + 1)
    # (the first layer of a block: the recomputation stops early, once it has what backward needs)
    model.visual.trunk.blocks[0].norm1.register_forward_hook(count("image"))
    model.transformer.resblocks[0].ln_1.register_forward_hook(count("text"))
    losses, _ = task(random_window((2,))[0])
    losses["loss"].backward()
    assert calls == {"image": 2, "text": 2}  # forward, and its recomputation in backward


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
    audit_case(replay_step, counted, loss, "linear", (1, 2, 5))
    assert len(calls) == 3  # replay: once per microbatch, as upstream


@pytest.mark.parametrize("accum,loss,mode,split", PER_REPLAY)
def test_per_replay_scale_bug_is_caught(make_task, accum, loss, mode, split):
    r = audit_case(bug_step("per-replay-scale", accum), make_task, loss, mode, split)
    assert r.tower_rel_err > 1e-2 and not r.passed


@pytest.mark.parametrize("accum,loss,mode,split", LOGIT_K_TIMES)
def test_logit_k_times_bug_is_caught(make_task, accum, loss, mode, split):
    r = audit_case(bug_step("logit-k-times", accum), make_task, loss, mode, split)
    for ratio in r.logit_ratios.values():
        assert ratio == pytest.approx(len(split), rel=1e-4)
    assert not r.passed


@pytest.mark.parametrize("accum,loss,split", UNREPLAYED)
def test_unreplayed_rng_bug_is_caught(make_task, accum, loss, split):
    r = audit_case(bug_step("no-rng-replay", accum), make_task, loss, "linear", split, stochastic=True)
    assert r.tower_rel_err > 1e-3 and not r.passed


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("accum", STEP_MODES)
def test_upstream_style_step_fails_the_audit(make_task, accum, loss):
    r = audit_case(bug_step("upstream-style", accum), make_task, loss, "linear", (2, 1))
    assert r.tower_rel_err > 0.1
    # linear: the per-replay scales sum to k times the window scale, so k = 2 here
    assert r.logit_ratios["logit_scale"] == pytest.approx(2.0, rel=1e-4)
    assert not r.passed
