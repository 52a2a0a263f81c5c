"""``--report-to wandb``: wandb's offline mode, read back (tests/wandb_records.py) against tensorboard's events."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
from longrun_common import SUBPROCESS_ENV, make_shards, run_argv

pytest.importorskip("wandb")  # the test extra installs it; `pip install -e .` alone does not
from wandb_records import history, run_info  # noqa: E402

HIDDEN = str(Path(__file__).resolve().parents[1] / "no_wandb")  # tests/conftest.py hides wandb from subprocesses
ENV = {**SUBPROCESS_ENV, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true",
       "PYTHONPATH": os.pathsep.join(p for p in SUBPROCESS_ENV["PYTHONPATH"].split(os.pathsep) if p != HIDDEN)}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_shards(tmp_path_factory.mktemp("wandb"))


def train(data, logs, name, *extra, epochs=1):
    argv = run_argv(data, "naflex-tiny", logs, name, "--report-to", "tensorboard,wandb", "--val-data", data.val,
                    "--wandb-project-name", "naflex-test", "--wandb-notes", "a note", *extra, epochs=epochs,
                    workers=0)
    proc = subprocess.run([sys.executable, "-m", "naflex_accum.train", *argv], capture_output=True, text=True,
                          timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def tensorboard_scalars(folder: Path) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    return {(tag, e.step): e.value for tag in events.Tags()["scalars"] for e in events.Scalars(tag)}


def wandb_scalars(run_file: Path) -> dict:
    return {(key, row["_step"]): value for row in history(run_file) for key, value in row.items()
            if not key.startswith("_")}


def as_tensorboard(wb: dict, steps_per_epoch: int = 4) -> dict:
    """wandb's scalars at tensorboard's steps: ``val/*`` goes to wandb at the epoch's last step, to tensorboard at
    the epoch."""
    return {(tag, (step + 1) // steps_per_epoch if tag.startswith("val/") else step): value
            for (tag, step), value in wb.items()}


def run_files(root: Path):
    return sorted(root.glob("wandb/offline-run-*/run-*.wandb"))


def test_wandb_gets_tensorboards_scalars_and_resumes_the_same_run(data, tmp_path):
    train(data, tmp_path, "run-1")
    root = tmp_path / "run-1"
    [first] = run_files(root)
    info = run_info(first)
    assert info == {"id": "run-1", "name": "run-1", "project": "naflex-test", "notes": "a note"}
    tb, wb = tensorboard_scalars(root / "tensorboard"), wandb_scalars(first)
    assert {"train/loss", "train/lr", "train/logit_scale", "val/image_to_text_R@1"} <= {t for t, _ in tb}
    assert ("val/clip_val_loss", 3) in wb and ("val/clip_val_loss", 1) in tb
    wb = as_tensorboard(wb)
    assert wb.keys() == tb.keys()  # the same names at the same steps (val/*: see as_tensorboard)
    assert all(wb[k] == pytest.approx(tb[k], rel=1e-6) for k in tb)  # tensorboard stores float32

    train(data, tmp_path, "run-1", "--resume", "latest", epochs=2)
    files = run_files(root)
    assert len(files) == 2 and run_info(files[1])["id"] == "run-1"  # the same wandb run, resumed
    tb, second = tensorboard_scalars(root / "tensorboard"), wandb_scalars(files[1])
    last = max(step for _, step in wandb_scalars(first))
    assert min(step for _, step in second) > last  # it goes on from the saved global step
    second = as_tensorboard(second)
    assert all(second[k] == pytest.approx(tb[k], rel=1e-6) for k in second)


def test_without_wandb_one_line_before_the_run_folder(data, tmp_path, capsys, monkeypatch):
    from naflex_accum.cli import main

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError, as when not installed
    argv = run_argv(data, "naflex-tiny", tmp_path, "x", "--report-to", "wandb", workers=0)
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "pip install 'naflex-accum[wandb]'" in err and "--report-to wandb" in err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("value", ["wandbb", "tensorboard,foo"])
def test_a_report_to_naming_no_sink_is_one_line(data, tmp_path, capsys, value):
    from naflex_accum.cli import main

    assert main(["train", *run_argv(data, "naflex-tiny", tmp_path, "x", "--report-to", value, workers=0)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "valid values are 'tensorboard', 'wandb', 'all'" in err
