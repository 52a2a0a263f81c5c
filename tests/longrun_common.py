"""Shared pieces of the long-run tests: one small run configuration, its uninterrupted weights, helpers.

The model has patch dropout, so a resume that restored the wrong random state
(or the wrong data position) ends with different weights.
"""
import json
import os
import sys
from pathlib import Path

import torch

from counted_step import CountedStep

SRC = Path(__file__).resolve().parent.parent
SUBPROCESS_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
                  "PYTHONPATH": str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def make_shards(folder: Path):
    from naflex_accum.data import write_demo_data
    return write_demo_data(folder / "data", num_samples=160, val_samples=32, seed=0)


def dropout_model(folder: Path) -> str:
    from naflex_accum.models import load_config

    config = load_config("naflex-tiny")
    config["vision_cfg"]["patch_dropout"] = 0.3
    path = folder / "tiny-dropout.json"
    path.write_text(json.dumps(config))
    return str(path)


def run_argv(shards, model_json, logs, name, *extra, epochs=2, samples=128, workers=1):
    """4 optimizer steps per epoch (2 microbatches of 16 each); ``logs`` None: no --logs/--name (a launcher's)."""
    folder = ["--logs-dir", str(logs), "--name", name] if logs is not None else []  # torchrun refuses --logs
    return ["--train-data", shards.train, "--model", model_json, "--naflex-seq-lens", "16",
            "--naflex-max-tokens-per-batch", "256", "--naflex-batch-divisor", "1", "--train-num-samples",
            str(samples), "--epochs", str(epochs), "--workers", str(workers), "--device", "cpu", "--lr", "1e-3",
            "--warmup", "2", "--accum-freq", "2", "--naflex-loss-scale", "sqrt", "--batch-size", "8",
            *folder, "--log-every-n-steps", "1", *extra]


def reference(tmp_path_factory):
    """(shards, model json, final weights of the uninterrupted run), made once per test session."""
    from types import SimpleNamespace

    folder = tmp_path_factory.getbasetemp() / "longrun-reference"
    done = folder / "weights.pt"
    if not done.exists():
        folder.mkdir(exist_ok=True)
        shards, model = make_shards(folder), dropout_model(folder)
        train_in_process(run_argv(shards, model, folder / "logs", "whole"))
        torch.save({"train": shards.train, "val": shards.val, "model": model,
                    "weights": weights(folder / "logs/whole/checkpoints/epoch_2.pt")}, done)
    saved = torch.load(done, weights_only=True)
    return SimpleNamespace(train=saved["train"], val=saved["val"]), saved["model"], saved["weights"]


def train_in_process(argv):
    from naflex_accum.train.main import train
    return train(argv)


def weights(path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)["state_dict"]


def assert_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"{len(differ)} tensors differ, e.g. {differ[:3]}"


def signal_at(monkeypatch, signum, microbatch: int):
    """Send ``signum`` to this process from inside the ``microbatch``-th call of the step (1-based, whole run)."""
    from naflex_accum.train import main

    real = main.select_step
    calls = {"n": 0}

    def before(n):
        calls["n"] = n
        if n == microbatch:
            os.kill(os.getpid(), signum)

    monkeypatch.setattr(main, "select_step", lambda args: CountedStep(real(args), before))
    return calls


def trainer_cmd(*argv):
    return [sys.executable, "-m", "naflex_accum.cli", "train", *argv]

