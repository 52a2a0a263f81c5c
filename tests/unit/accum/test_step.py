"""The step's contract with upstream's training loop, bad inputs, RNG, sync, scaler and DDP."""
import copy
import pickle
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

from naflex_accum import CachedLossStep, ReplayStep, cached_loss_step, replay_step
from naflex_accum.accum.contract import split_result, task_result
from naflex_accum.accum.step import total_loss
from naflex_accum.errors import StepError
from naflex_accum.testing.older_order import older as older_order
from naflex_accum.upstream.audit import (GradProbe, audit_case, compare, concat_batches, full_batch_grads, named_params,
                                         random_window, window_spec)

from .test_contract import losses_only


def make_args(**kw):
    base = dict(accum_freq=2, batch_size=4, naflex_loss_scale="linear", grad_clip_norm=None)
    base.update(kw)
    return SimpleNamespace(**base)


class CountingModule(torch.nn.Module):
    """Wraps a model; counts forwards and records gradient-sync switches (FSDP2's method)."""

    def __init__(self, model, fsdp_like=False):
        super().__init__()
        self.module = model
        self.forwards = 0
        self.sync_calls = []
        if fsdp_like:
            self.set_requires_gradient_sync = self.sync_calls.append

    def forward(self, **kw):
        self.forwards += 1
        return self.module(**kw)


@pytest.fixture
def counted(make_task):
    def build(loss="clip", fsdp_like=False):
        task = make_task(loss, False)
        task.trainable_module = CountingModule(task.trainable_module, fsdp_like)
        return task
    return build


@pytest.fixture(params=["replay", "cached-loss"], autouse=True)
def step(request, monkeypatch):
    """Every contract test runs for both accumulation modes."""
    fn = {"replay": replay_step, "cached-loss": cached_loss_step}[request.param]
    monkeypatch.setitem(STEP, "fn", fn)
    return fn


STEP = {"fn": cached_loss_step}


def run_window(task, batches, args, optimizer=None, scaler=None):
    optimizer = optimizer or GradProbe(named_params(task))
    state = ([], {}) if args.accum_freq > 1 else None
    results = [STEP["fn"](task, b, state, optimizer, scaler, nullcontext, args) for b in batches]
    return results, optimizer


def test_returns_none_while_filling_then_contract(counted):
    task = counted()
    batches = random_window((3, 1, 2))
    results, probe = run_window(task, batches, make_args(accum_freq=3))
    assert results[0] is None and results[1] is None
    losses, report, step_batch_size, new_state = results[2]
    assert step_batch_size == 6 and new_state == ([], {})
    assert set(report) == {"logit_scale"} and "contrastive_loss" in losses
    assert probe.steps == 1
    assert task.trainable_module.forwards == 5  # k caching forwards + k-1 replays: the last is not replayed
    ref_grads, ref_loss = full_batch_grads(task, batches, [0, 0, 0], chunked=False)
    assert losses["loss"].item() == pytest.approx(ref_loss, rel=1e-5)  # unscaled window loss
    assert not losses["loss"].requires_grad


def test_accum_freq_one_uses_its_own_scale(make_task):
    task = make_task("siglip", False)
    (batch,) = random_window((3,))
    ref, _ = full_batch_grads(task, [batch], [0], chunked=False)
    results, probe = run_window(task, [batch], make_args(accum_freq=1, batch_size=4))
    losses, report, n, state = results[0]
    assert n == 3 and state is None and set(report) == {"logit_scale", "logit_bias"}
    err, worst, ratios = compare(probe.grads, ref, 0.75)
    assert err <= 1e-5, worst
    assert ratios == {"logit_scale": pytest.approx(1.0, rel=1e-5), "logit_bias": pytest.approx(1.0, rel=1e-5)}


@pytest.mark.parametrize("kw,match", [
    (dict(batch_size=0), "positive --batch-size.*0"),
    (dict(batch_size=-3), "positive --batch-size.*-3"),
    (dict(batch_size=2.5), "positive --batch-size.*2.5"),
    (dict(batch_size=True), "positive --batch-size.*True"),
    (dict(batch_size=None), "positive --batch-size.*None"),
    (dict(naflex_loss_scale="cubic"), "--naflex-loss-scale 'cubic'"),
    (dict(accum_freq=0), "--accum-freq"),
    (dict(accum_freq=1, batch_size=0), "positive --batch-size"),
])
def test_bad_input_raises_before_any_forward(counted, kw, match):
    task = counted()
    with pytest.raises(ValueError, match=match):
        run_window(task, random_window((1, 2)), make_args(**kw))
    assert task.trainable_module.forwards == 0


def test_mixed_window_raises_before_the_dense_forward(counted):
    task = counted()
    naflex, other = random_window((2, 2))
    dense = {"image": torch.rand(2, 3, 32, 32), "text": other["text"]}
    with pytest.raises(ValueError, match=r"NaFlex at positions \[0\], dense at positions \[1\]"):
        run_window(task, [naflex, dense], make_args())
    assert task.trainable_module.forwards == 1


def test_empty_microbatch_is_refused(counted):
    task = counted()
    (b,) = random_window((2,))
    empty = {"image": {k: v[:0] for k, v in b["image"].items()}, "text": b["text"][:0]}
    with pytest.raises(ValueError, match="position 1 of the window has size 0"):
        run_window(task, [b, empty], make_args())
    assert task.trainable_module.forwards == 1  # the last microbatch is refused before its forward


@pytest.fixture(params=["report", "losses"])
def generation(request, counted):
    """Builds a counted task speaking upstream's current (report) or older (losses alone) contract generation."""
    return lambda: losses_only(counted()) if request.param == "losses" else counted()


def call(task, batch, state, probe, k=2):
    return STEP["fn"](task, batch, state, probe, None, nullcontext, make_args(accum_freq=k))


def refused(match, task, batch, state, probe, k=2):
    """The call raises one StepError line matching ``match`` before any forward (so before any backward)."""
    forwards = task.trainable_module.forwards
    with pytest.raises(StepError, match=match) as info:
        call(task, batch, state, probe, k)
    assert "\n" not in str(info.value)
    assert task.trainable_module.forwards == forwards


def test_a_closed_state_passed_again_is_refused_before_any_forward(generation):
    task = generation()
    probe = GradProbe(named_params(task))
    b0, b1, b2, b3 = random_window((2, 1, 2, 1))
    spent = ([], {})
    assert call(task, b0, spent, probe) is None
    fresh = call(task, b1, spent, probe)[-1]
    refused("window has already made its optimizer step.*pass the accum_state the step returned",
            task, b2, spent, probe)
    assert call(task, b2, fresh, probe) is None
    refused("already made its optimizer step", task, b3, spent, probe)  # mid-way through the next window
    assert split_result(call(task, b3, fresh, probe))[1] == 3 and probe.steps == 2
    ref, _ = full_batch_grads(task, [b2, b3], [0, 0], chunked=False)  # the refusals left no trace in it
    err, worst, _ = compare(probe.grads, ref, 3 / 8)
    assert err <= 1e-5, worst


@pytest.mark.parametrize("again", [lambda s: pickle.loads(pickle.dumps(s)), copy.deepcopy, copy.copy],
                         ids=["pickled", "deep-copied", "copied"])
def test_a_closed_state_pickled_or_copied_is_refused_before_any_forward(generation, again):
    task = generation()
    probe = GradProbe(named_params(task))
    b0, b1, b2 = random_window((2, 1, 2))
    spent = ([], {})
    call(task, b0, spent, probe)
    call(task, b1, spent, probe)
    refused("window has already made its optimizer step", task, b2, again(spent), probe)


def _exact(task, probe, batches):
    """The probe's gradients are the window's full-batch ones (a window of sizes 1, 2, 1 has scale 1/3)."""
    ref, _ = full_batch_grads(task, batches, [0] * len(batches), chunked=False)
    err, worst, _ = compare(probe.grads, ref, 1 / 3)
    assert probe.steps == 1 and err <= 1e-5, worst


@pytest.mark.parametrize("position", [1, 2], ids=["midway", "last"])
def test_a_forward_that_fails_leaves_the_window_as_it_was(generation, position):
    task = generation()
    probe = GradProbe(named_params(task))
    batches = random_window((1, 2, 1))
    bad = dict(batches[position], text=torch.full_like(batches[position]["text"], 10 ** 6))  # no such token
    state = ([], {})
    for b in batches[:position]:
        call(task, b, state, probe, 3)
    with pytest.raises(IndexError):
        call(task, bad, state, probe, 3)
    assert len(state[0]) == position and probe.steps == 0
    results = [call(task, b, state, probe, 3) for b in batches[position:]]  # that microbatch again, and on
    assert split_result(results[-1])[1] == 4
    _exact(task, probe, batches)


def test_a_window_that_fails_after_its_forwards_is_refused(generation):
    task = generation()
    probe = GradProbe(named_params(task))
    b0, b1, b2 = random_window((1, 2, 1))
    state = ([], {})
    call(task, b0, state, probe)
    task.compute_accum_loss = lambda *a: (_ for _ in ()).throw(RuntimeError("loss failed"))
    with pytest.raises(RuntimeError, match="loss failed"):
        call(task, b1, state, probe)
    del task.compute_accum_loss
    refused("window failed after its forwards .in its loss, backward or optimizer step.", task, b2, state, probe)
    assert probe.steps == 0


def _added_by_hand(task, probe, b0, b1):
    state = ([], {})
    call(task, b0, state, probe, 3)
    state[0].append(b1)
    return state


def _one_window_in_two_states(task, probe, b0, b1):
    state = ([], {})
    call(task, b0, state, probe, 3)
    copy = (list(state[0]), state[1])
    call(task, b1, state, probe, 3)
    return copy


def _replaced_by_hand(task, probe, b0, b1):
    state = ([], {})
    call(task, b0, state, probe, 3)
    state[0][0] = b1
    return state


@pytest.mark.parametrize("make_state,match", [
    (_added_by_hand, "has 2 in its batch list but its window kept outputs of 1"),
    (_replaced_by_hand, "holds another batch at position 0 than the one the step admitted there"),
    (_one_window_in_two_states, "has 1 in its batch list but its window kept outputs of 2"),
    (lambda task, probe, b0, b1: ([b0], {}), "has 1 in its batch list but this step admitted none of them"),
], ids=["batch-added-by-hand", "batch-replaced-by-hand", "one-window-in-two-states", "begun-by-another-step"])
def test_a_state_out_of_step_with_its_window_is_refused(generation, make_state, match):
    task = generation()
    probe = GradProbe(named_params(task))
    b0, b1, b2 = random_window((1, 2, 1))
    refused(match, task, b2, make_state(task, probe, b0, b1), probe, 3)
    assert probe.steps == 0


def test_a_window_filled_through_two_models_is_refused_before_the_second_forward(generation):
    task, other = generation(), generation()
    probe = GradProbe(named_params(task))
    b0, b1 = random_window((2, 1))
    state = ([], {})
    call(task, b0, state, probe)
    refused(r"microbatch 1 of the window came through another model than microbatch 0 \(task.trainable_module's: "
            r"\w+ at 0x[0-9a-f]+; microbatch 0's: \w+ at 0x[0-9a-f]+\)",
            other, b1, state, GradProbe(named_params(other)))
    assert task.trainable_module.forwards == 1 and all(p.grad is None for p in other.parameters())
    result = call(copy.copy(task), b1, state, probe)  # another task object around the same model is one model
    assert split_result(result)[1] == 3 and probe.steps == 1


def test_a_compiled_wrapper_made_anew_for_each_microbatch_is_one_model(generation):
    task = generation()
    model, probe = task.trainable_module, GradProbe(named_params(task))
    batches = random_window((1, 2, 1))
    state = ([], {})
    with torch.compiler.set_stance("force_eager"):  # the wrappers' identity is under test, not compiling
        for b in batches:
            task.trainable_module = torch.compile(model, backend="eager")
            result = call(task, b, state, probe, 3)
    assert split_result(result)[1] == 4
    _exact(task, probe, batches)


def test_a_deep_copy_of_a_partly_filled_state_is_a_window_of_its_own(generation):
    task = generation()
    probe = GradProbe(named_params(task))
    batches = random_window((1, 2, 1))
    state = ([], {})
    call(task, batches[0], state, probe, 3)
    copied = copy.deepcopy(state)
    for b in batches[1:]:
        call(task, b, copied, probe, 3)
    _exact(task, probe, batches)
    refused("microbatch 1 of the window cannot be checked against microbatch 0's model: the state was pickled",
            task, batches[1], pickle.loads(pickle.dumps(state)), probe, 3)
    for b in batches[1:]:  # the original goes on as it was
        call(task, b, state, probe, 3)
    assert probe.steps == 2


@pytest.mark.parametrize("state,match", [
    (([], []), r"a \(list, dict\) pair.*got a tuple \(list, list\)"),
    ("([], {})", "got a str"),
    (([], {}, []), r"got a tuple \(list, dict, list\)"),
], ids=["list-list", "str", "three"])
def test_an_accum_state_of_another_form_is_refused(counted, state, match):
    task = counted()
    refused(match, task, random_window((1,))[0], state, GradProbe(named_params(task)))


def test_an_accum_state_as_a_list_pair_is_taken(counted):
    task = counted()
    probe, state = GradProbe(named_params(task)), [[], {}]
    results = [call(task, b, state, probe) for b in random_window((1, 2))]
    assert results[0] is None and split_result(results[1])[1] == 3


def test_older_order_replays_every_microbatch(counted, step):
    task = counted()
    mode = {"replay_step": ReplayStep, "cached_loss_step": CachedLossStep}[step.__name__]
    older = older_order(mode)()
    state = ([], {})
    for batch in random_window((3, 1, 2)):
        older(task, batch, state, GradProbe(named_params(task)), None, nullcontext, make_args(accum_freq=3))
    assert task.trainable_module.forwards == 6  # k caching forwards + k replays


def test_dense_window_is_unscaled(make_task):
    task = make_task("clip", False)
    g = torch.Generator().manual_seed(0)
    batches = [{"image": torch.rand(n, 3, 32, 32, generator=g), "text": torch.randint(1, 400, (n, 32), generator=g)}
               for n in (1, 3)]
    ref, _ = full_batch_grads(task, [concat_batches(batches)], [0], chunked=False)
    _, probe = run_window(task, batches, make_args(batch_size=0))  # dense runs never read --batch-size
    err, worst, ratios = compare(probe.grads, ref, 1.0)
    assert err <= 1e-5, worst
    assert ratios["logit_scale"] == pytest.approx(1.0, rel=1e-5)


@pytest.mark.parametrize("checkpointing", (False, True), ids=("plain", "grad-checkpointing"))
def test_rng_stream_outside_is_undisturbed(make_task, checkpointing):
    task = make_task("clip", True)
    task.trainable_module.set_grad_checkpointing(checkpointing)  # its recomputation must not draw either
    batches = random_window((2, 1))
    torch.manual_seed(7)
    run_window(task, batches, make_args())
    after_step = torch.rand(4)
    torch.manual_seed(7)
    with torch.no_grad():
        for b in batches:
            task.trainable_module(**b)  # what the caching passes alone draw
    torch.testing.assert_close(after_step, torch.rand(4), rtol=0, atol=0)


def test_sync_off_for_all_but_last_replay(counted):
    task = counted(fsdp_like=True)
    run_window(task, random_window((1, 2, 1)), make_args(accum_freq=3))
    assert task.trainable_module.sync_calls == [False, True, False, True]


def test_a_logit_parameter_the_loss_leaves_out_keeps_no_gradient(make_task):
    """CoCa's task drops logit_bias from the loss: as after a full-batch backward, it has no gradient (not a
    zero one, which weight decay would act on), while logit_scale has one."""
    task = make_task("coca", False, logit_bias=True)
    batches = random_window((2, 1, 3), spec=window_spec("coca"))
    run_window(task, batches, make_args(accum_freq=3), optimizer=torch.optim.SGD(task.parameters(), lr=0.0))
    model = task.trainable_module
    assert model.logit_bias.grad is None and model.logit_scale.grad is not None
    task.zero_grad(set_to_none=True)
    losses, _, _ = task_result(task(concat_batches(batches)), "task(batch)", None)
    total_loss(losses).backward()  # the full-batch backward
    assert model.logit_bias.grad is None and model.logit_scale.grad is not None


def test_clip_once_per_window_and_clamp_after_step(counted, monkeypatch):
    task = counted()
    calls = []
    real_clip = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda *a, **k: calls.append(1) or real_clip(*a, **k))
    with torch.no_grad():
        task.trainable_module.module.logit_scale.fill_(9.0)
    run_window(task, random_window((2, 2)), make_args(grad_clip_norm=1.0),
               optimizer=torch.optim.SGD(task.parameters(), lr=0.0))
    assert calls == [1]
    assert task.trainable_module.module.logit_scale.item() == pytest.approx(4.6052, abs=1e-4)


def _grad_scaler():
    try:
        return torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    except Exception as exc:  # pragma: no cover - depends on the torch build
        pytest.skip(f"torch.amp.GradScaler('cpu') unavailable here: {exc}")


@pytest.mark.parametrize("split", ((1, 2), (5, 2, 1)), ids=str)
def test_grad_scaler_path(make_task, step, split):
    r = audit_case(step, make_task, "siglip", "linear", split, scaler=_grad_scaler())
    assert r.passed, r


def test_grad_scaler_unscales_before_clipping(make_task):
    scaler = _grad_scaler()
    task = make_task("clip", False)
    seen = []
    real_clip = torch.nn.utils.clip_grad_norm_

    def spy(params, max_norm, **kw):
        params = list(params)
        seen.append(torch.cat([p.grad.flatten() for p in params if p.grad is not None]).norm().item())
        return real_clip(params, max_norm, **kw)

    batches = random_window((1, 2))
    ref, _ = full_batch_grads(task, batches, [0, 0], chunked=False)
    ref_norm = torch.cat([g.flatten() for g in ref.values()]).norm().item() * 3 / 8
    torch.nn.utils.clip_grad_norm_ = spy
    try:
        run_window(task, batches, make_args(grad_clip_norm=1e9), scaler=scaler)
    finally:
        torch.nn.utils.clip_grad_norm_ = real_clip
    assert seen == [pytest.approx(ref_norm, rel=1e-4)]


def test_ddp_world_size_one(tmp_path, make_task, step):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        def ddp_task(loss, stochastic):
            task = make_task(loss, stochastic)
            task.trainable_module = DDP(task.trainable_module)
            return task
        for split in ((1, 2), (2, 1, 3)):
            r = audit_case(step, ddp_task, "clip", "linear", split)
            assert r.passed, r
            r = audit_case(step, ddp_task, "siglip", "sqrt", split, stochastic=True)
            assert r.passed, r
    finally:
        dist.destroy_process_group()


def test_a_window_mixing_ddp_and_its_bare_model_is_refused(tmp_path, generation):
    """The gradient sync rides on the DDP wrapper (no_sync on all but the last backward): a window that goes
    through DDP and then the bare model would sync nothing, so the two are two models here."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        task = generation()
        bare, probe = task.trainable_module, GradProbe(named_params(task))
        batches, state = random_window((1, 2)), ([], {})
        task.trainable_module = wrapped = DDP(bare)  # kept alive: the window holds it weakly
        call(task, batches[0], state, probe, 2)
        task.trainable_module = bare
        refused("came through another model than microbatch 0", task, batches[1], state, probe, 2)
        del wrapped
    finally:
        dist.destroy_process_group()
