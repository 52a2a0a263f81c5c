"""On a GPU only (skipped elsewhere): the training loop reads nothing from the device between its checks.

``torch.cuda.set_sync_debug_mode("error")`` is on while every epoch runs; the loop's one read per check and
its saves are the only places that lift it (``monitor.host_read``). timm's NaFlexVit reads each sample's
grid size from the device in its default learned position embedding (``calculate_naflex_grid_sizes``,
one ``.item()`` per sample and forward), which is the model's choice, not the loop's: the first test
switches that tower to its sync-free ``grid_sample`` path; the second lists where syncs come from with
timm's default, and asserts none comes from the loop. Self-contained, about a minute.
"""
import warnings
from pathlib import Path

import pytest
import torch
from longrun_common import make_shards, run_argv, train_in_process

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return make_shards(tmp_path_factory.mktemp("cuda"))


def cuda_argv(shards, logs, name, *extra):
    argv = run_argv(shards, "naflex-tiny", logs, name, "--check-every-n-steps", "3", "--log-every-n-steps", "100",
                    "--save-every-n-steps", "4", *extra, epochs=2, workers=1)
    return [a if a != "cpu" else "cuda" for a in argv]


def epochs_under(monkeypatch, mode: str):
    from naflex_accum.train import main

    real = main.train_one_epoch

    def under_debug_mode(*args, **kwargs):
        torch.cuda.set_sync_debug_mode(mode)
        try:
            return real(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    monkeypatch.setattr(main, "train_one_epoch", under_debug_mode)


def sync_free_position_embedding(monkeypatch):
    from naflex_accum.train import main

    real = main.build_task

    def build(*args, **kwargs):
        task, model = real(*args, **kwargs)
        for module in model.modules():
            if hasattr(module, "pos_embed_use_grid_sample"):
                module.pos_embed_use_grid_sample = True
        return task, model
    monkeypatch.setattr(main, "build_task", build)


@pytest.mark.parametrize("precision", ["fp32", "amp_bf16"])
def test_no_host_sync_between_checks(shards, tmp_path, monkeypatch, precision):
    sync_free_position_embedding(monkeypatch)
    epochs_under(monkeypatch, "error")
    result = train_in_process(cuda_argv(shards, tmp_path, "sync", "--precision", precision))
    assert result["exit_code"] == 0 and result["global_step"] == 8
    assert (tmp_path / "sync/checkpoints/step_8.pt").is_file()


def test_where_syncs_come_from_with_timms_default_position_embedding(shards, tmp_path, monkeypatch):
    epochs_under(monkeypatch, "warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_in_process(cuda_argv(shards, tmp_path, "warn"))
    sites = {}
    for w in caught:
        if "synchroniz" in str(w.message).lower():
            key = f"{Path(w.filename).parent.name}/{Path(w.filename).name}:{w.lineno}"
            sites[key] = sites.get(key, 0) + 1
    print("host syncs by source line over 16 microbatches:", sites)
    assert not [k for k in sites if k.startswith("train/")], sites
