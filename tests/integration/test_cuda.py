"""The accumulation step on a CUDA GPU: RNG replay of GPU dropout, bf16 autocast, fp16 GradScaler (inf window too).

Skipped without a GPU; self-contained (tiny random models, no data), well
under a minute. The same checks as the CPU tests, where CUDA's own random
generator and kernels are what could differ: the replayed microbatches must
draw the caching pass's masks from the CUDA generator, and the stream outside
the step must be left where the caching forwards leave it.
"""
import functools
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
from unit.accum.test_precision import CountingSGD

from naflex_accum import cached_loss_step, replay_step
from naflex_accum.testing.bugs import bug_step
from naflex_accum.upstream.audit import audit_case, default_task_factory, random_window, to_device

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ACCUM = {"replay": replay_step, "cached-loss": cached_loss_step}
FP32_TOL = 1e-4  # GPU reductions are not bit-reproducible across shapes; TF32 is switched off below
BF16_TOL, LOGIT_TOL = 5e-2, 2e-2


@pytest.fixture(autouse=True)
def strict_fp32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def check(r, tol, logit_tol):
    assert r.tower_rel_err <= tol, f"tower grad off by {r.tower_rel_err:.2e} at {r.worst_param}"
    assert all(abs(v - 1.0) <= logit_tol for v in r.logit_ratios.values()), r.logit_ratios
    assert r.step_batch_size == sum(r.split)


@pytest.mark.parametrize("loss", ("clip", "siglip", "coca"))
@pytest.mark.parametrize("accum", ACCUM)
def test_cuda_rng_replay_is_exact(accum, loss):
    """Patch dropout 0.5, drop path and attention dropout, drawn on the GPU: replays draw the same masks."""
    for split in ((1, 2), (5, 2, 1)):
        r = audit_case(ACCUM[accum], default_task_factory, loss, "linear", split, stochastic=True, device="cuda")
        check(r, FP32_TOL, FP32_TOL)


@pytest.mark.parametrize("accum", ACCUM)
def test_cuda_unreplayed_rng_is_caught(accum):
    r = audit_case(bug_step("no-rng-replay", accum), default_task_factory, "clip", "linear", (2, 1),
                   stochastic=True, device="cuda")
    assert r.tower_rel_err > 1e-2


@pytest.mark.parametrize("accum", ACCUM)
def test_cuda_rng_stream_outside_is_undisturbed(accum):
    task = default_task_factory("siglip", True).cuda().train()
    batches = [to_device(b, "cuda") for b in random_window((2, 1, 3))]
    args = SimpleNamespace(accum_freq=3, batch_size=4, naflex_loss_scale="linear", grad_clip_norm=None)
    torch.manual_seed(7)
    state = ([], {})
    for batch in batches:
        ACCUM[accum](task, batch, state, torch.optim.SGD(task.parameters(), lr=0.0), None, nullcontext, args)
    after_step = torch.rand(4, device="cuda")
    torch.manual_seed(7)
    with torch.no_grad():
        for batch in batches:
            task.trainable_module(**batch)  # what the caching passes alone draw
    torch.testing.assert_close(after_step, torch.rand(4, device="cuda"), rtol=0, atol=0)


@pytest.mark.parametrize("loss", ("clip", "siglip", "coca"))
@pytest.mark.parametrize("accum", ACCUM)
def test_cuda_bf16_autocast_equivalence(accum, loss):
    bf16 = functools.partial(torch.autocast, "cuda", dtype=torch.bfloat16)
    for split in ((1, 2), (5, 2, 1)):
        r = audit_case(ACCUM[accum], default_task_factory, loss, "linear", split, stochastic=True, autocast=bf16,
                       device="cuda")
        check(r, BF16_TOL, LOGIT_TOL)


@pytest.mark.parametrize("init_scale,overflows", ((2.0 ** 40, True), (2.0 ** 8, False)))
@pytest.mark.parametrize("accum", ACCUM)
def test_cuda_fp16_grad_scaler_window(accum, init_scale, overflows):
    """An overflowing fp16 window is skipped and halves the scale (upstream's finish); a finite one steps."""
    fp16 = functools.partial(torch.autocast, "cuda", dtype=torch.float16)
    task = default_task_factory("clip", True).cuda().train()
    optimizer, scaler = CountingSGD(task.parameters()), torch.amp.GradScaler("cuda", init_scale=init_scale)
    before = [p.detach().clone() for p in task.parameters()]
    args = SimpleNamespace(accum_freq=3, batch_size=4, naflex_loss_scale="linear", grad_clip_norm=1.0)
    state = ([], {})
    for batch in random_window((2, 1, 3)):
        ACCUM[accum](task, to_device(batch, "cuda"), state, optimizer, scaler, fp16, args)
    unchanged = all(torch.equal(p, b) for p, b in zip(task.parameters(), before))
    if overflows:
        assert optimizer.steps == 0 and unchanged and scaler.get_scale() == init_scale / 2
    else:
        assert optimizer.steps == 1 and not unchanged and scaler.get_scale() == init_scale


@pytest.mark.parametrize("accum", ACCUM)
def test_cuda_fp16_grad_scaler_equivalence(accum):
    fp16 = functools.partial(torch.autocast, "cuda", dtype=torch.float16)
    r = audit_case(ACCUM[accum], default_task_factory, "siglip", "linear", (3, 1, 2), autocast=fp16,
                   scaler=torch.amp.GradScaler("cuda", init_scale=2.0 ** 8), device="cuda")
    check(r, 1e-2, 1e-2)


@pytest.mark.parametrize("flatten", [True, False])
def test_cuda_normalises_uint8_patches_as_the_cpu(flatten):
    # The loader hands uint8 patches over and the task normalises them on the device: the GPU's kernels
    # (one pass, a mask for the padding) must give the CPU's per-image floats, padding exactly zero.
    from naflex_accum.data.patches import normalize_patches, patchify_images
    from naflex_accum.tasks import ContrastiveTask

    g = torch.Generator().manual_seed(0)
    images = [torch.randint(0, 256, (3, 16 * h, 16 * w), generator=g, dtype=torch.uint8) for h, w in
              ((2, 3), (4, 4), (1, 5))]
    cpu = patchify_images(images, 16, 16, flatten)
    batch = {"image": cpu, "text": torch.zeros(3, 4, dtype=torch.long)}
    gpu = ContrastiveTask(torch.nn.Identity(), None).prepare_batch(batch, "cuda")["image"]
    expected = normalize_patches(cpu)["patches"]
    assert gpu["patches"].is_cuda and gpu["patches"].dtype == torch.float32
    assert torch.allclose(gpu["patches"].cpu(), expected, atol=1e-6, rtol=0)
    padding = gpu["patches"][~gpu["patch_valid"]]
    assert (padding == 0).all() and not torch.signbit(padding).any()
