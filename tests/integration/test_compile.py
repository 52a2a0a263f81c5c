"""``--torchcompile``: compiled runs against eager ones, recompiles counted, masks under compile, DDP.

Runs in this process (dynamo's counters are read back); the model has patch dropout, so a compiled
replay that drew other masks than its caching pass would show. Compiling costs tens of seconds a
run on 2 cores the first time (Inductor caches its kernels on disk after that).
"""
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from longrun_common import SUBPROCESS_ENV, dropout_model, make_shards, run_argv, train_in_process, weights

SEQ_LENS = ("16", "36", "64")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("compile")
    return folder, make_shards(folder), dropout_model(folder)


def argv(setup, name, *extra):
    folder, shards, model = setup
    out = run_argv(shards, model, folder / "logs", name, "--lr", "1e-4", *extra, epochs=2, workers=0)
    at = out.index("--naflex-seq-lens")
    return out[:at + 1] + list(SEQ_LENS) + out[at + 2:]


@pytest.fixture(scope="module")
def runs():
    """Each in-process run once per module (a compiled one costs tens of seconds): ``runs(argv)`` trains and
    returns the frames dynamo compiled in each of its epochs, counted from a reset dynamo; ``runs.shapes[name]``
    the recompiles of each frame that a shape caused (``shape_recompiles``)."""
    done, shapes = {}, {}

    def run(args):
        name = args[args.index("--name") + 1]
        if name not in done:
            torch._dynamo.reset()
            with pytest.MonkeyPatch.context() as monkeypatch:
                done[name] = frames_per_epoch(monkeypatch)
                train_in_process(args)
            shapes[name] = shape_recompiles()
        return done[name]
    run.shapes = shapes
    return run


def shape_recompiles():
    """Frame -> the reasons dynamo gave for recompiling it since its reset, grad-mode changes left out."""
    from torch._dynamo.utils import guard_failures

    return {f"{code.co_filename}:{code.co_name}": [r for r in map(str, reasons) if "GLOBAL_STATE" not in r]
            for code, reasons in guard_failures.items()}


def frames_per_epoch(monkeypatch):
    """Frames dynamo compiles in each epoch of the next run."""
    from torch._dynamo.utils import counters

    from naflex_accum.train import main

    per_epoch, real = [], main.train_one_epoch

    def counted(*args, **kwargs):
        before = counters["frames"]["total"]
        real(*args, **kwargs)
        per_epoch.append(counters["frames"]["total"] - before)
    monkeypatch.setattr(main, "train_one_epoch", counted)
    return per_epoch


def max_diff(a, b):
    """Largest weight difference, the attention key biases left out: their true gradient is exactly 0 (a
    softmax does not see a constant added to every key), and AdamW turns the round-off there, which
    compiled and eager kernels make differently, into steps of the learning rate's size."""
    assert a.keys() == b.keys()
    out = 0.0
    for k in a:
        x, y = a[k], b[k]
        if k.endswith("attn.in_proj_bias"):
            width = x.numel() // 3
            x, y = torch.cat((x[:width], x[2 * width:])), torch.cat((y[:width], y[2 * width:]))
        out = max(out, float((x - y).abs().max()))
    return out


def compiled_argv(setup, mode):
    """The compiled run of ``mode``, with gradient checkpointing: each compiled model in this file checkpoints, so
    that Inductor compiles one set of kernels (a minute each set, with its cache empty) and the other run reuses
    it; without checkpointing the compile is the same ``compile_model`` call."""
    return argv(setup, f"compiled-{mode}", "--accum-mode", mode, "--torchcompile", "--grad-checkpointing")


def test_compiled_runs_match_eager_and_compile_nothing_after_the_first_epoch(setup, runs):
    """--accum-mode cached-loss, the default; replay's step under compile is checked against a full-batch backward
    below (a trainer run of its own would cost a minute more)."""
    folder, mode = setup[0], "cached-loss"
    runs(argv(setup, f"eager-{mode}", "--accum-mode", mode))
    per_epoch = runs(compiled_argv(setup, mode))
    eager, compiled = (weights(folder / f"logs/{n}-{mode}/checkpoints/epoch_2.pt") for n in ("eager", "compiled"))
    assert max_diff(eager, compiled) < 1e-5
    assert max_diff(eager, weights(folder / f"logs/eager-{mode}/checkpoints/epoch_1.pt")) > 1e-4  # it trained
    # three sequence lengths: a graph for the first, a dynamic one the others reuse; none in epoch 2
    assert per_epoch[0] > 0 and per_epoch[1] == 0, per_epoch
    log = (folder / f"logs/compiled-{mode}/out.log").read_text()  # logged before the run folder existed
    assert "torch.compile: the model (inductor), batch dimension dynamic, Inductor on eager's" in log, log[:2000]


def test_three_sequence_lengths_recompile_each_frame_once_for_its_shapes(setup, runs):
    """A graph for the first shape, a dynamic one that every other length and batch size reuses: a frame
    recompiles for a shape once at most (its other recompiles are grad-mode changes)."""
    runs(compiled_argv(setup, "cached-loss"))
    found = runs.shapes["compiled-cached-loss"]
    assert any(found.values()) and all(len(reasons) <= 1 for reasons in found.values()), found


def test_compiled_accumulation_equals_a_compiled_full_batch_backward_with_the_same_masks():
    from torch._dynamo.utils import counters

    from naflex_accum import cached_loss_step, replay_step
    from naflex_accum.accum.scales import window_loss_scale
    from naflex_accum.models import create_model
    from naflex_accum.tasks import create_task
    from naflex_accum.train.model.compile import compile_model, mark_batch_dynamic
    from naflex_accum.upstream.audit import accumulated_grads, compare, full_batch_grads, random_window

    torch._dynamo.reset()
    options = SimpleNamespace(naflex_seq_lens=[36, 16], naflex_patch_sizes=[16], torchcompile_backend=None,
                              torchcompile_mode=None, grad_checkpointing=True)
    torch.manual_seed(0)
    model = create_model("naflex-tiny", patch_dropout=0.3)
    model.set_grad_checkpointing(True)
    task = create_task(model)
    compile_model(model, options)  # in place: no wrapper, the model's own keys
    assert task.trainable_module is model and "_orig_mod" not in "".join(model.state_dict())
    task.train()
    split, seeds = (3, 5), [11, 12]
    # the compiled runs' model, checkpointing, lengths and dynamic batch dimension: most of their kernels are
    # Inductor's cached ones here (a minute saved when the cache starts empty)
    batches = random_window(split, seed=1, seq_lens=[36, 16])
    for batch in batches:
        mark_batch_dynamic(batch)
    # compiled and eager draw the same masks from the same RNG state (Inductor's fallback_random)
    torch.manual_seed(7)
    with torch.compiler.set_stance("force_eager"):
        eager_out = model(**batches[0])["image_features"]
    torch.manual_seed(7)
    frames = counters["frames"]["total"]
    compiled_out = model(**batches[0])["image_features"]
    assert counters["frames"]["total"] > frames  # the call compiled: the model's own __call__ is compiled
    assert torch.allclose(eager_out, compiled_out, atol=1e-5)
    reference, _ = full_batch_grads(task, batches, seeds, chunked=True)
    args = SimpleNamespace(accum_freq=2, batch_size=4, naflex_loss_scale="linear", grad_clip_norm=None)
    scale = window_loss_scale(list(split), 4, "linear")
    for step in (cached_loss_step, replay_step):
        grads, _, _ = accumulated_grads(step, task, batches, seeds, args)
        err, worst, ratios = compare(grads, reference, scale)
        assert err <= 1e-5 and all(abs(r - 1) <= 1e-5 for r in ratios.values()), (step, err, worst, ratios)


def test_compiled_under_ddp_matches_eager_ddp(setup):
    """DDP's no_sync in the window under compile, with AOTAutograd's backward (Inductor's kernels, whose numbers
    the tests above check, are left out: each rank would lower its graphs again), without --grad-checkpointing:
    dynamo's graph split at DDP's buckets refuses the trainer's one bucket per parameter (an AssertionError on
    the first step) unless the trainer turns it off."""
    folder, shards, model = setup
    out = {}
    compiled = ["--torchcompile", "--torchcompile-backend", "aot_eager"]
    for name, extra in (("ddp-eager", []), ("ddp-compiled", compiled)):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "naflex_accum.train", "--logs-dir", str(folder / "logs"), "--name", name,
               *run_argv(shards, model, None, name, "--lr", "1e-4", *extra, epochs=1, workers=0)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=SUBPROCESS_ENV)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[name] = weights(folder / "logs" / name / "checkpoints/epoch_1.pt")
    assert max_diff(out["ddp-eager"], out["ddp-compiled"]) < 1e-5
    assert "torch.compile: the model (aot_eager)" in proc.stdout + proc.stderr  # it did compile


def test_compile_with_fsdp_or_another_strategy_is_one_line(capsys):
    from naflex_accum.cli import main

    base = ["--train-data", "x.tar", "--device", "cpu", "--torchcompile"]
    for flags, needle in ((["--fsdp"], "--fsdp with --torchcompile is not offered"),
                          (["--torchcompile-strategy", "task"], "valid values here: 'model'")):
        assert main(["train", *base, *flags]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and needle in err, err
