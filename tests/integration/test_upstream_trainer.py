"""Upstream open_clip main's own trainer through the runner, end to end, on the pinned snapshots.

Tiny runs on demo shards: a NaFlex CLIP (``--use-naflex --accum-freq 2
--naflex-loss-scale linear``, upstream's default precision ``amp_bf16``, so
under bf16 autocast) through ``python -m naflex_accum.openclip`` on each pinned
commit, and a CoCa (dense images, ``--accum-freq 2``) in a process whose
logging runs at WARNING; and, on 89fb801, the NaFlex CLIP on two CPU ranks under ``--fsdp``
(upstream's FSDP2 with bf16 parameters and fp32 reduction). Each must self-check, train, write its checkpoint, and
leave in its run folder the record that the fix ran, in which mode, on which
upstream (version, contract, fingerprint) and with which verdict (``out.log``
and ``params.txt``).
"""
import dataclasses

import pytest
import torch
from upstream_real import DETERMINISTIC, JOBS, PINNED, run_python, tail, upstream_env

import naflex_accum

INSTALLED = (f"naflex-accum {naflex_accum.__version__}: open_clip_train.train._train_step_eager replaced by "
             f"naflex_accum.")


def _install_lines(text: str):
    return [line for line in text.splitlines() if INSTALLED in line]


def _check_run_folder(folder, mode: str, version: str = "4.2.0.dev0"):
    checkpoint = torch.load(folder / "checkpoints" / "epoch_1.pt", map_location="cpu", weights_only=False)
    assert checkpoint["epoch"] == 1 and checkpoint["state_dict"]
    assert all(torch.isfinite(v).all() for v in checkpoint["state_dict"].values() if v.is_floating_point())
    log = (folder / "out.log").read_text()
    lines = _install_lines(log)
    assert len(lines) == 1, log[:2000]
    assert f"(accumulation mode {mode}: one loss scale per accumulation window; open_clip_torch {version}; " \
           f"contract " in lines[0] and "| naflex_accum.openclip |" in lines[0]
    params = (folder / "params.txt").read_text().splitlines()
    assert f"naflex_accum: {mode} (naflex-accum {naflex_accum.__version__})" in params
    return log, {line.split(": ", 1)[0]: line.split(": ", 1)[1] for line in params if line.startswith("naflex_accum")}


def _clip_run(pinned, demo_shards, tmp_path, **env):
    from naflex_accum.upstream.tiny_tasks import write_model_dir

    model = write_model_dir(str(tmp_path / "tiny-clip"), "clip")
    args = ["-m", "naflex_accum.openclip", "--use-naflex", "--model", model, "--train-data", demo_shards,
            "--dataset-type", "webdataset", "--train-num-samples", "40", "--batch-size", "16",
            "--naflex-seq-lens", "16", "64", pinned.tokens_flag, "512", "--accum-freq", "2",
            "--naflex-loss-scale", "linear", "--epochs", "1", "--workers", "0", "--lr", "1e-3", "--warmup", "0",
            "--device", "cpu", "--logs", tmp_path / "logs", "--name", "clip"]
    return run_python(pinned.src, args, cwd=tmp_path,
                      env=upstream_env(pinned.src, NAFLEX_ACCUM_MODE=None, **DETERMINISTIC, **env))


def test_runner_checks_trains_upstream_naflex_clip_and_records_the_fix(pinned, demo_shards, tmp_path):
    proc = _clip_run(pinned, demo_shards, tmp_path)
    assert proc.returncode == 0, tail(proc)
    log, record = _check_run_folder(tmp_path / "logs" / "clip", "cached-loss", pinned.version)
    assert "Train Epoch: 0 [40/40 (100%)]" in log  # both microbatches (32 + 8), one optimizer step
    assert record["naflex_accum_upstream"].startswith(f'open_clip {pinned.version}, contract "{pinned.contract}"')
    assert f"(CLIPTask; verified in CI on upstream {pinned.commit} " in record["naflex_accum_fingerprint"]
    assert record["naflex_accum_verify"].startswith(
        "PASS 8/8 rows (CLIPTask, --naflex-loss-scale linear, accumulation mode cached-loss, tiny CPU model) "
        "on 1 rank")
    assert record["naflex_accum_changes"].startswith("one loss scale per window; the logit gradient counted once; "
                                                     "stochastic layers replayed")
    for line in ("| naflex_accum.openclip | upstream: open_clip", "| naflex_accum.openclip | self-check: PASS 8/8",
                 "| naflex_accum.openclip | upstream's own step, audited the same way: lacks: one loss scale"):
        assert line in log, line
    said = [line for line in proc.stderr.splitlines() if line.startswith("naflex-accum: ")]
    assert len(said) == 4 and said[2].startswith("naflex-accum: self-check: PASS"), said  # install, then the check
    for text in ("_train_step_eager replaced by naflex_accum.cached_loss_step", "upstream: open_clip ",
                 "self-check: PASS 8/8 rows", "upstream's own step, audited the same way: "):  # each once
        once = [line for line in proc.stderr.splitlines() if text in line and "naflex_accum_" not in line]
        assert len(once) == 1 and once[0].startswith("naflex-accum: "), (text, once)
        assert len([line for line in log.splitlines() if text in line and "| naflex_accum.openclip |" in line]) == 1


def test_runner_without_the_check_says_so(upstream_src, demo_shards, tmp_path):
    pinned = dataclasses.replace(PINNED["89fb801"], src=upstream_src)
    proc = _clip_run(pinned, demo_shards, tmp_path, NAFLEX_ACCUM_VERIFY="0")
    assert proc.returncode == 0, tail(proc)
    log, record = _check_run_folder(tmp_path / "logs" / "clip", "cached-loss")
    assert record["naflex_accum_verify"] == "skipped (NAFLEX_ACCUM_VERIFY=0)"
    assert "| self-check: skipped (NAFLEX_ACCUM_VERIFY=0): the step was not audited on this run's task" in log
    assert "verified in CI on upstream 89fb801" in record["naflex_accum_fingerprint"]


@pytest.mark.parametrize("mode", [pytest.param(None, id="default"), "replay"])
def test_runner_trains_upstream_coca_with_logging_at_warning(upstream_src, demo_shards, tmp_path, mode):
    from naflex_accum.upstream.tiny_tasks import write_model_dir

    # Named "coca" so upstream's main picks its CoCaTask; weights saved (see write_model_dir).
    model = write_model_dir(str(tmp_path / "tiny-coca"), "coca", weights=True)
    args = [JOBS / "warning_runner.py", "--model", model, "--train-data", demo_shards,
            "--dataset-type", "webdataset", "--train-num-samples", "8", "--batch-size", "4", "--accum-freq", "2",
            "--epochs", "1", "--workers", "0", "--lr", "1e-3", "--warmup", "0", "--device", "cpu",
            "--logs", tmp_path / "logs", "--name", "coca"]
    proc = run_python(upstream_src, args, cwd=tmp_path,
                      env=upstream_env(upstream_src, NAFLEX_ACCUM_MODE=mode, **DETERMINISTIC))
    assert proc.returncode == 0, tail(proc)
    log, record = _check_run_folder(tmp_path / "logs" / "coca", mode or "cached-loss")
    assert "| INFO | open_clip_train" not in log  # upstream's own INFO lines were dropped
    assert record["naflex_accum_verify"].startswith("PASS 8/8 rows (CoCaTask, --naflex-loss-scale none")
    # Logging configured at WARNING before the install: its lines go to stderr, not nowhere.
    said = [line for line in proc.stderr.splitlines() if line.startswith("naflex-accum: ")]
    assert len(said) == 4 and "upstream's own step, audited the same way: lacks: the logit gradient" in said[3]
    assert "not shown: one loss scale per window" in said[3]  # dense CoCa windows have no scale to get wrong


# the newer pin only: FSDP's gradient sync in the step does not depend on the task contract, which the runs above
# take on both pins
@pytest.mark.parametrize("pinned", ["89fb801"], indirect=True, ids=["upstream-89fb801"])
def test_runner_trains_upstream_naflex_clip_under_fsdp_bf16_on_two_ranks(pinned, demo_shards, tmp_path):
    """``--fsdp`` at upstream's default ``--precision amp_bf16``: FSDP2 computes in bf16 and keeps the
    gradients of the window's unsynced backwards in fp32; the window's synced backward must not mix dtypes."""
    import math

    from naflex_accum.upstream.tiny_tasks import write_model_dir

    model = write_model_dir(str(tmp_path / "tiny-clip"), "clip")
    # torchrun takes --logs as its own flag anywhere on the line: upstream writes ./logs under cwd
    args = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "naflex_accum.openclip",
            "--use-naflex", "--model", model, "--train-data", demo_shards, "--dataset-type", "webdataset",
            "--train-num-samples", "40", "--batch-size", "8", "--naflex-seq-lens", "16", "64", pinned.tokens_flag,
            "256", "--accum-freq", "2", "--naflex-loss-scale", "linear", "--epochs", "1", "--workers", "0", "--lr",
            "1e-3", "--warmup", "0", "--device", "cpu", "--fsdp", "--name", "fsdp"]
    proc = run_python(pinned.src, args, cwd=tmp_path,
                      env=upstream_env(pinned.src, NAFLEX_ACCUM_MODE=None, OMP_NUM_THREADS="1", **DETERMINISTIC))
    assert proc.returncode == 0, tail(proc)
    log, record = _check_run_folder(tmp_path / "logs" / "fsdp", "cached-loss", pinned.version)
    assert "FSDP2: MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)" in log
    assert "Train Epoch: 0 [40/40 (100%)]" in log and "on all 2 ranks" in record["naflex_accum_verify"]
    saved = torch.load(tmp_path / "logs/fsdp/checkpoints/epoch_1.pt", map_location="cpu", weights_only=False)
    assert abs(float(saved["state_dict"]["logit_scale"]) - math.log(1 / 0.07)) > 1e-4  # it took its gradient
