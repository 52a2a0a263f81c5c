"""train.output.report: --report-to takes open_clip's values; anything else, or wandb without the package, is one line."""
import builtins

import pytest

from naflex_accum.errors import UsageError
from naflex_accum.train.output.report import check_wandb, run_id, sinks


@pytest.mark.parametrize("value, expected", [
    (None, set()), ("", set()), ("none", set()), ("tensorboard", {"tensorboard"}), ("all", {"tensorboard", "wandb"}),
    (" wandb , tensorboard ", {"tensorboard", "wandb"}), ("all,wandb", {"tensorboard", "wandb"}),
])
def test_open_clips_values(value, expected):
    assert sinks(value) == expected


def test_an_unknown_sink_is_one_line_listing_the_valid_ones():
    with pytest.raises(UsageError, match=r"^--report-to 'tensorboard,mlflow': mlflow is not a sink here; valid "
                                         r"values are 'tensorboard', 'wandb', 'all'"):
        sinks("tensorboard,mlflow")


def test_wandb_without_the_package_is_refused_before_anything_runs(monkeypatch):
    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("No module named 'wandb'")
        return real_import(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", no_wandb)
    check_wandb("tensorboard")  # wandb not asked for: no check
    with pytest.raises(UsageError, match=r"--report-to all: wandb is not installed; install it with pip install"):
        check_wandb("all")


def test_run_id_is_the_folder_name_with_refused_characters_replaced():
    assert run_id("2024_01_01-model_ViT-B-16-lr_0.001") == "2024_01_01-model_ViT-B-16-lr_0.001"
    assert run_id("my run/é:1") == "my-run---1" and len(run_id("x" * 300)) == 128
