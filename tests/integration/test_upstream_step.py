"""One optimizer step of upstream open_clip main's own trainer, patched, against an unaccumulated reference.

Run on each pinned upstream commit (both contract generations).

``upstream_jobs/one_step.py`` runs upstream's ``main`` on NaFlex demo shards with
``--accum-freq 2 --naflex-loss-scale linear``, sequence lengths 16 and 64 under a
512-token budget, so its schedule sizes the window's two batches 512/16 = 32 and
512/64 = 8: a split upstream scales wrongly (each replay by its own size). Run
once per mode with the patch and once without, from the same seed on the same
examples; the reference is upstream's own one-batch step on the same examples
at the same scale, from the same weights and optimizer (SGD, so the update is
the gradient). It also drives each step into an fp16 GradScaler overflow.
"""
import pytest
from upstream_real import DETERMINISTIC, JOBS, last_json, run_python, upstream_env

from naflex_accum.accum.modes import ACCUM_MODES


@pytest.fixture(scope="module")
def outcome(pinned, demo_shards, tmp_path_factory):
    from naflex_accum.upstream.tiny_tasks import write_model_dir

    work = tmp_path_factory.mktemp("one-step")
    model = write_model_dir(str(work / "tiny-clip"), "clip")
    env = upstream_env(pinned.src, **DETERMINISTIC)
    return last_json(run_python(pinned.src, [JOBS / "one_step.py", work, demo_shards, model, pinned.tokens_flag],
                                cwd=work, env=env))


def test_the_window_is_uneven_and_every_run_saw_the_same_examples_and_init(outcome):
    assert outcome["split"] == [32, 8] and outcome["seq_lens"] == [16, 64], outcome
    assert outcome["same_data"] and outcome["same_init"]
    assert outcome["update_norm"] > 0.1  # the step moved the weights well above fp32 round-off


@pytest.mark.parametrize("mode", ACCUM_MODES)
def test_patched_step_equals_the_unaccumulated_reference(outcome, mode):
    assert outcome["rel_err"][mode] <= 1e-5, outcome["rel_err"]


def test_upstreams_own_step_is_off(outcome):
    assert outcome["rel_err"]["upstream"] > 1e-2, outcome["rel_err"]


def test_fp16_overflow_skips_the_step_and_backs_off_like_upstream(outcome):
    upstream = outcome["overflow"]["upstream"]
    assert upstream["returned"] and upstream["weights_unchanged"] and upstream["nonfinite_grads"] > 0
    assert upstream["scale_after"] == 2.0 ** 99  # GradScaler's backoff (0.5) from 2 ** 100
    for mode in ACCUM_MODES:
        assert outcome["overflow"][mode] == upstream, mode
