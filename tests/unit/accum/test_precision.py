"""Reduced precision on the CPU: bf16 autocast equivalence, and fp16 GradScaler windows with inf gradients.

bf16: both modes against one full-batch backward under the same autocast.
Measured on this CPU (worst parameter, relative): 2.2e-2 CLIP, 1.5e-2 SigLIP,
2.8e-2 CoCa; two full-batch references that differ only in chunking the
forward differ by 0.4e-2 to 2.8e-2 themselves (bf16 rounds each matmul once per
shape). The tolerance is 5e-2 for tower parameters and 2e-2 for the logit
ratios; every reference bug misses it by more than 6x (checked below).

FSDP2 under upstream's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``
(``--fsdp --precision amp_bf16``), on one in-process gloo rank: the unsharded
parameters compute in bf16 and the gradients that accumulate without sync are
kept in fp32, so the window's backwards must all reach the same parameters
(else the synced one mixes dtypes and FSDP refuses to reduce-scatter); the
gradients must match one full-batch backward under the same policy, same tolerance.

fp16 + GradScaler: a window whose scaled gradients overflow must be skipped by
the optimizer and back the scale off, as upstream's ``_finish_eager_train_step``
does (``scaler.step`` skips, ``scaler.update`` halves the scale).
"""
import functools
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
from pairwise import pairwise
from unit.accum.test_equivalence import ACCUM

from naflex_accum.testing.bugs import bug_step
from naflex_accum.upstream.audit import audit_case, default_task_factory, random_window

BF16_TOL, BF16_LOGIT_TOL = 5e-2, 2e-2
bf16 = functools.partial(torch.autocast, "cpu", dtype=torch.bfloat16)
fp16 = functools.partial(torch.autocast, "cpu", dtype=torch.float16)


def assert_close_bf16(r):
    assert r.tower_rel_err <= BF16_TOL, f"tower grad off by {r.tower_rel_err:.2e} at {r.worst_param}"
    for name, ratio in r.logit_ratios.items():
        assert ratio == pytest.approx(1.0, abs=BF16_LOGIT_TOL), f"{name} gradient ratio {ratio}"
    assert r.loss_rel_err <= 1e-2 and r.step_batch_size == sum(r.split)


@pytest.mark.parametrize("accum,loss,stochastic,split", pairwise(  # every pair of them (tests/pairwise.py)
    accum=tuple(ACCUM), loss=("clip", "siglip", "coca"), stochastic=("plain", "stochastic"), split=((1, 2), (5, 2, 1))))
def test_bf16_autocast_equivalence(accum, loss, stochastic, split):
    assert_close_bf16(audit_case(ACCUM[accum], default_task_factory, loss, "linear", split,
                                 stochastic=stochastic == "stochastic", autocast=bf16))


@pytest.mark.parametrize("accum", ACCUM)
def test_bf16_tolerance_still_catches_every_bug(accum):
    r = audit_case(bug_step("per-replay-scale", accum), default_task_factory, "siglip", "linear", (1, 2),
                   autocast=bf16)
    assert r.tower_rel_err > 6 * BF16_TOL
    r = audit_case(bug_step("no-rng-replay", accum), default_task_factory, "clip", "linear", (1, 2),
                   stochastic=True, autocast=bf16)
    assert r.tower_rel_err > 6 * BF16_TOL
    r = audit_case(bug_step("logit-k-times", accum), default_task_factory, "coca", "none", (2, 1), autocast=bf16)
    assert r.logit_ratios["logit_scale"] == pytest.approx(2.0, abs=BF16_LOGIT_TOL)


@pytest.fixture
def fsdp2_bf16(tmp_path):
    """A task factory whose model is FSDP2-sharded (blocks, then the root) over one gloo rank, as upstream's
    ``--fsdp --precision amp_bf16`` shards it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    def make(loss, stochastic):
        task = default_task_factory(loss, stochastic)
        model = task.trainable_module
        for name in ("logit_scale", "logit_bias"):  # FSDP2 shards no 0-dim parameter; upstream's makes them [1]
            if getattr(model, name, None) is not None:
                setattr(model, name, torch.nn.Parameter(getattr(model, name).detach().reshape(1)))
        for block in [*model.visual.trunk.blocks, *model.transformer.resblocks]:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return task
    try:
        yield make
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("accum", ACCUM)
def test_fsdp2_bf16_policy_equivalence(fsdp2_bf16, accum):
    for loss, split in (("siglip", (1, 3, 2)), ("clip", (2, 1))):
        assert_close_bf16(audit_case(ACCUM[accum], fsdp2_bf16, loss, "linear", split, stochastic=True))
    r = audit_case(bug_step("per-replay-scale", accum), fsdp2_bf16, "siglip", "linear", (1, 3, 2))
    assert r.tower_rel_err > 6 * BF16_TOL  # the tolerance still tells a wrong scale


class CountingSGD(torch.optim.SGD):
    def __init__(self, params):
        super().__init__(params, lr=0.1)
        self.steps = 0

    def step(self, closure=None):
        self.steps += 1
        return super().step(closure)


def run_fp16_window(step, init_scale, split=(2, 1, 3)):
    task = default_task_factory("clip", True)
    task.train()
    optimizer = CountingSGD(task.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    before = {n: p.detach().clone() for n, p in task.named_parameters()}
    args = SimpleNamespace(accum_freq=len(split), batch_size=4, naflex_loss_scale="linear", grad_clip_norm=1.0)
    state, result = ([], {}), None
    for batch in random_window(split):
        result = step(task, batch, state, optimizer, scaler, fp16, args)
    assert result is not None and result[3] == ([], {})
    changed = [n for n, p in task.named_parameters() if not torch.equal(p, before[n])]
    grads_finite = all(torch.isfinite(p.grad).all() for p in task.parameters() if p.grad is not None)
    return optimizer.steps, scaler, changed, grads_finite


@pytest.mark.parametrize("accum", ACCUM)
def test_fp16_inf_window_skips_the_step_and_backs_the_scale_off(accum):
    steps, scaler, changed, finite = run_fp16_window(ACCUM[accum], init_scale=2.0 ** 30)
    assert not finite  # the window really overflowed
    assert steps == 0  # scaler.step found inf and skipped optimizer.step
    assert changed == []  # clipping and the logit clamp touched nothing either
    assert scaler.get_scale() == 2.0 ** 29  # scaler.update: init_scale * backoff_factor 0.5
    assert scaler._get_growth_tracker() == 0


@pytest.mark.parametrize("accum", ACCUM)
def test_fp16_finite_window_steps_and_keeps_the_scale(accum):
    steps, scaler, changed, finite = run_fp16_window(ACCUM[accum], init_scale=2.0 ** 8)
    assert finite and steps == 1 and changed
    assert scaler.get_scale() == 2.0 ** 8 and scaler._get_growth_tracker() == 1


@pytest.mark.parametrize("split", ((1, 2), (3, 1, 2)), ids=str)
@pytest.mark.parametrize("accum", ACCUM)
def test_fp16_grad_scaler_equivalence(accum, split):
    """A finite fp16 window: the unscaled gradients match an fp16 full-batch backward (fp16 tolerance)."""
    r = audit_case(ACCUM[accum], default_task_factory, "siglip", "linear", split, autocast=fp16,
                   scaler=torch.amp.GradScaler("cpu", init_scale=2.0 ** 8))
    assert r.tower_rel_err <= 1e-2, (r.tower_rel_err, r.worst_param)
    assert all(ratio == pytest.approx(1.0, abs=1e-2) for ratio in r.logit_ratios.values())


def test_autocast_factory_is_called_per_forward():
    """The step enters ``autocast()`` itself, as upstream passes a factory, never a context object."""
    entered = []

    def autocast():
        entered.append(1)
        return nullcontext()
    task = default_task_factory("clip", False)
    args = SimpleNamespace(accum_freq=2, batch_size=4, naflex_loss_scale="linear", grad_clip_norm=None)
    for accum, step in ACCUM.items():
        entered.clear()
        state = ([], {})
        for batch in random_window((1, 2)):
            step(task, batch, state, torch.optim.SGD(task.parameters(), lr=0.0), None, autocast, args)
        assert len(entered) >= 3, accum  # k caching forwards, the replay, the loss
