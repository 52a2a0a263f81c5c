"""The built-in trainer's run folder against upstream open_clip main's, made with the same flags.

Upstream's trainer (pinned 89fb801, through ``python -m naflex_accum.openclip``) and ``naflex-accum train``
each train 2 epochs of 2 optimizer steps on the same demo shards, evaluating after each epoch. Their folders
must hold the same files, the same tensorboard tags at the same steps (ours may add the few extras listed
here, no more), ``checkpoints/results.jsonl`` lines with the same keys, and ``End epoch N`` lines. A run
stopped inside an epoch and resumed appends to ``results.jsonl``, ending with the uninterrupted run's lines.
"""
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from longrun_common import SUBPROCESS_ENV, signal_at, train_in_process
from upstream_real import DETERMINISTIC, run_python, tail, upstream_env

# Ours alone: the run lock (rundir.RunLock), and scalars upstream has no name for.
OURS_ONLY_FILES = {".lock"}
OURS_ONLY_TAGS = {"train/window_scale", "train/window_samples", "train/image_tokens_per_second"}


def flags(data: Path, logs: Path, name: str) -> list:
    return ["--train-data", str(data / "train" / "shard-{000000..000000}.tar"),
            "--val-data", str(data / "val" / "shard-{000000..000000}.tar"), "--train-num-samples", "64",
            "--batch-size", "16", "--naflex-seq-lens", "16", "--naflex-max-tokens-per-batch", "256",
            "--accum-freq", "2", "--epochs", "2", "--workers", "0", "--lr", "1e-3", "--warmup", "0",
            "--device", "cpu", "--report-to", "tensorboard", "--log-every-n-steps", "1",
            "--logs", str(logs), "--name", name]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """96 training samples (2 steps of 2 windows of 16 per epoch) and 16 held out, one shard each."""
    from naflex_accum import cli

    folder = tmp_path_factory.mktemp("parity") / "demo"
    assert cli.main(["make-demo-data", str(folder), "--num-samples", "96", "--val-samples", "16",
                     "--shard-size", "96", "--processes", "1"]) == 0
    return folder


@pytest.fixture(scope="module")
def folders(upstream_src, data, tmp_path_factory):
    """(ours, upstream's) run folders."""
    from naflex_accum.upstream.tiny_tasks import write_model_dir

    tmp = tmp_path_factory.mktemp("parity-runs")
    model = write_model_dir(str(tmp / "tiny-clip"), "clip")
    theirs = run_python(upstream_src, ["-m", "naflex_accum.openclip", "--use-naflex", "--model", model,
                                       "--dataset-type", "webdataset", "--val-num-samples", "16",
                                       *flags(data, tmp / "upstream", "run")],
                        cwd=tmp, env=upstream_env(upstream_src, NAFLEX_ACCUM_MODE=None, **DETERMINISTIC))
    assert theirs.returncode == 0, tail(theirs)
    ours = subprocess.run([sys.executable, "-m", "naflex_accum.cli", "train", "--model", "naflex-tiny",
                           *flags(data, tmp / "ours", "run")], cwd=tmp, env=SUBPROCESS_ENV,
                          capture_output=True, text=True, timeout=600)
    assert ours.returncode == 0, tail(ours)
    return tmp / "ours" / "run", tmp / "upstream" / "run"


def files(root: Path) -> set:
    """Relative paths, tensorboard's event files (named after host and pid) by their pattern."""
    names = set()
    for path in root.rglob("*"):
        if path.is_file():
            rel = path.relative_to(root).as_posix()
            names.add("tensorboard/events.out.tfevents.*" if rel.startswith("tensorboard/events.out.") else rel)
    return names


def scalars(root: Path) -> dict:
    """``{tag: [steps]}`` of the run's tensorboard events."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(root / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [e.step for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def results(root: Path) -> list:
    return [json.loads(line) for line in (root / "checkpoints" / "results.jsonl").read_text().splitlines()]


def test_the_same_files(folders):
    ours, theirs = folders
    assert files(theirs) <= files(ours), sorted(files(theirs) - files(ours))
    assert files(ours) - files(theirs) == OURS_ONLY_FILES


def test_upstreams_tensorboard_tags_at_upstreams_steps(folders):
    ours, theirs = map(scalars, folders)
    missing = sorted(set(theirs) - set(ours))
    assert not missing, missing
    assert set(ours) - set(theirs) == OURS_ONLY_TAGS
    wrong = {tag: (ours[tag], steps) for tag, steps in theirs.items() if ours[tag] != steps}
    assert not wrong, wrong  # (ours, upstream's): train/* at the step's index, val/* at the epoch
    assert theirs["val/clip_val_loss"] == [1, 2] and theirs["train/loss"] == [0, 1, 2, 3]


def test_results_jsonl_lines_with_upstreams_keys(folders):
    ours, theirs = map(results, folders)
    assert [list(line) for line in ours] == [list(line) for line in theirs]  # the same keys in the same order
    assert [(line["epoch"], line["num_samples"]) for line in ours] == [(1, 16), (2, 16)]
    assert all(type(ours[0][k]) is type(theirs[0][k]) for k in theirs[0]), (ours[0], theirs[0])


def test_end_epoch_lines_name_the_epoch(folders):
    for root in folders:
        log = (root / "out.log").read_text()
        assert "End epoch 0 | Avg Contrastive_loss: " in log and "End epoch 1 | Avg Contrastive_loss: " in log, root


def test_a_run_resumed_inside_an_epoch_appends_to_results_jsonl(data, tmp_path, monkeypatch):
    """Stopped after the first step of epoch 1 (its 6th microbatch), resumed: epoch 1's line is kept as it was,
    epoch 2's is appended, and the whole file equals the uninterrupted run's (the resume is exact); resumed from
    epoch_2.pt for a third epoch, it appends epoch 3's."""
    def argv(name, *extra):
        return ["--model", "naflex-tiny", *flags(data, tmp_path, name), *extra]

    whole = tmp_path / "whole" / "checkpoints" / "results.jsonl"
    train_in_process(argv("whole"))
    signal_at(monkeypatch, signal.SIGUSR1, 6)
    first = train_in_process(argv("cut"))
    monkeypatch.undo()
    assert first["preempted"] and first["epoch"] == 1
    cut = tmp_path / "cut" / "checkpoints" / "results.jsonl"
    before = cut.read_text()
    assert [json.loads(line)["epoch"] for line in before.splitlines()] == [1]
    assert train_in_process(argv("cut", "--resume", "latest"))["exit_code"] == 0
    after = cut.read_text()
    assert after.startswith(before) and after == whole.read_text()
    assert scalars(tmp_path / "cut")["val/clip_val_loss"] == [1, 2]
    assert train_in_process(argv("cut", "--resume", "latest", "--epochs", "3"))["exit_code"] == 0  # from epoch_2.pt
    lines = cut.read_text().splitlines()
    assert cut.read_text().startswith(after) and [json.loads(line)["epoch"] for line in lines] == [1, 2, 3]
