"""Upstream open_clip main's own trainer through the runner, end to end, on the pinned snapshot.

Tiny runs on demo shards: a NaFlex CLIP (``--use-naflex --accum-freq 2
--naflex-loss-scale linear``, upstream's default precision ``amp_bf16``, so
under bf16 autocast) through ``python -m naflex_accum.openclip``, and a CoCa
(dense images, ``--accum-freq 2``) in a process whose logging runs at WARNING.
Each must train, write its checkpoint, and leave in its run folder the record
that the fix ran and in which mode (``out.log`` and ``params.txt``).
"""
import pytest
import torch

import naflex_accum
from upstream_real import DETERMINISTIC, JOBS, run_python, tail, upstream_env

INSTALLED = (f"naflex-accum {naflex_accum.__version__}: open_clip_train.train._train_step_eager replaced by "
             f"naflex_accum.")


def _install_lines(text: str):
    return [line for line in text.splitlines() if INSTALLED in line]


def _check_run_folder(folder, mode: str):
    checkpoint = torch.load(folder / "checkpoints" / "epoch_1.pt", map_location="cpu", weights_only=False)
    assert checkpoint["epoch"] == 1 and checkpoint["state_dict"]
    assert all(torch.isfinite(v).all() for v in checkpoint["state_dict"].values() if v.is_floating_point())
    log = (folder / "out.log").read_text()
    lines = _install_lines(log)
    assert len(lines) == 1, log[:2000]
    assert f"(accumulation mode {mode}: one loss scale per accumulation window; open_clip_torch 4.2.0.dev0)" \
        in lines[0] and "| naflex_accum.openclip |" in lines[0]
    params = (folder / "params.txt").read_text().splitlines()
    assert f"naflex_accum: {mode} (naflex-accum {naflex_accum.__version__})" in params
    return log


def test_runner_trains_upstream_naflex_clip_and_records_the_fix(upstream_src, demo_shards, tmp_path):
    from naflex_accum.upstream_tasks import write_model_dir

    model = write_model_dir(str(tmp_path / "tiny-clip"), "clip")
    args = ["-m", "naflex_accum.openclip", "--use-naflex", "--model", model, "--train-data", demo_shards,
            "--dataset-type", "webdataset", "--train-num-samples", "40", "--batch-size", "16",
            "--naflex-seq-lens", "16", "64", "--naflex-max-tokens-per-batch", "512", "--accum-freq", "2",
            "--naflex-loss-scale", "linear", "--epochs", "1", "--workers", "0", "--lr", "1e-3", "--warmup", "0",
            "--device", "cpu", "--logs", tmp_path / "logs", "--name", "clip"]
    proc = run_python(upstream_src, args, cwd=tmp_path,
                      env=upstream_env(upstream_src, NAFLEX_ACCUM_MODE=None, **DETERMINISTIC))
    assert proc.returncode == 0, tail(proc)
    log = _check_run_folder(tmp_path / "logs" / "clip", "cached-loss")
    assert "Train Epoch: 0 [40/40 (100%)]" in log  # both microbatches (32 + 8), one optimizer step
    assert len([line for line in proc.stderr.splitlines() if line.startswith("naflex-accum: ")]) == 1


@pytest.mark.parametrize("mode", [pytest.param(None, id="default"), "replay"])
def test_runner_trains_upstream_coca_with_logging_at_warning(upstream_src, demo_shards, tmp_path, mode):
    from naflex_accum.upstream_tasks import write_model_dir

    # Named "coca" so upstream's main picks its CoCaTask; weights saved (see write_model_dir).
    model = write_model_dir(str(tmp_path / "tiny-coca"), "coca", weights=True)
    args = [JOBS / "warning_runner.py", "--model", model, "--train-data", demo_shards,
            "--dataset-type", "webdataset", "--train-num-samples", "8", "--batch-size", "4", "--accum-freq", "2",
            "--epochs", "1", "--workers", "0", "--lr", "1e-3", "--warmup", "0", "--device", "cpu",
            "--logs", tmp_path / "logs", "--name", "coca"]
    proc = run_python(upstream_src, args, cwd=tmp_path,
                      env=upstream_env(upstream_src, NAFLEX_ACCUM_MODE=mode, **DETERMINISTIC))
    assert proc.returncode == 0, tail(proc)
    log = _check_run_folder(tmp_path / "logs" / "coca", mode or "cached-loss")
    assert "| INFO | open_clip_train" not in log  # upstream's own INFO lines were dropped
    # Logging configured at WARNING before the install: its line goes to stderr, not nowhere.
    assert len([line for line in proc.stderr.splitlines() if line.startswith("naflex-accum: ")]) == 1
