"""A reader that has gone (``naflex-accum export CKPT DIR | head -1``), or a full disk under stdout: every command
still does its work and exits with its own status, with no traceback; what it would have printed goes nowhere. The
reader is gone before the command starts (a pipe whose reading end is closed), so every write to stdout fails."""
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from longrun_common import SUBPROCESS_ENV

from naflex_accum.data import write_demo_data
from naflex_accum.models import create_model
from naflex_accum.train.kept.checkpoint import save_checkpoint
from naflex_accum.train.kept.resume import epoch_payload

CONSOLE_SCRIPT = Path(sys.executable).with_name("naflex-accum")


def run_reader_gone(args, timeout=300, buffered=False, full=False):
    """``naflex-accum ARGS`` with its stdout a pipe nobody reads any more (``full``: ``/dev/full``, a disk with no
    room left): ``(exit status, stderr)``. ``buffered``: Python's default for a pipe, where the writes fail at the
    end (else each print fails, as with ``PYTHONUNBUFFERED=1``)."""
    if full:
        write = os.open("/dev/full", os.O_WRONLY)
    else:
        read, write = os.pipe()
        os.close(read)
    env = {k: v for k, v in SUBPROCESS_ENV.items() if k != "PYTHONUNBUFFERED" or not buffered}
    try:
        proc = subprocess.run([str(CONSOLE_SCRIPT), *args], stdout=write, stderr=subprocess.PIPE,
                              stdin=subprocess.DEVNULL, env={**env, "PYTHONUNBUFFERED": "1"} if not buffered else env,
                              timeout=timeout)
    finally:
        os.close(write)
    return proc.returncode, proc.stderr.decode(errors="replace")


def quiet(err: str) -> bool:
    return not any(word in err for word in ("Traceback", "BrokenPipe", "Exception ignored", "Logging error", "Errno"))


@pytest.mark.parametrize("buffered", [False, True], ids=["unbuffered", "buffered"])
def test_export(tmp_path, buffered):
    torch.manual_seed(0)
    model = create_model("naflex-tiny")
    state = SimpleNamespace(epoch=1, global_step=1, samples_seen=8, lr_steps_per_epoch=1, scaler=None,
                            optimizer=torch.optim.AdamW(model.parameters()))
    save_checkpoint(tmp_path / "epoch_1.pt", epoch_payload(state, model, SimpleNamespace(name="x",
                                                                                        naflex_patch_sizes=[16])))
    code, err = run_reader_gone(["export", str(tmp_path / "epoch_1.pt"), str(tmp_path / "out"), "--model",
                                 "naflex-tiny"], buffered=buffered)
    assert code == 0 and quiet(err), err[-3000:]
    assert (tmp_path / "out" / "open_clip_model.safetensors").is_file()


@pytest.mark.parametrize("args", [["--version"], ["--help"], ["train", "--help"], ["export", "--help"]], ids=str)
def test_help_and_version(args):
    code, err = run_reader_gone(args)
    assert code == 0 and quiet(err), err[-3000:]


def test_make_demo_data_and_train(tmp_path):
    code, err = run_reader_gone(["make-demo-data", str(tmp_path / "data"), "--num-samples", "64", "--val-samples",
                                 "16", "--processes", "1"])
    assert code == 0 and quiet(err), err[-3000:]
    shards = write_demo_data(tmp_path / "data", num_samples=64, val_samples=16, seed=0, processes=1)
    code, err = run_reader_gone(["train", "--train-data", shards.train, "--val-data", shards.val, "--model",
                                 "naflex-tiny", "--naflex-seq-lens", "16", "--naflex-max-tokens-per-batch", "128",
                                 "--naflex-batch-divisor", "1", "--train-num-samples", "64", "--epochs", "1",
                                 "--workers", "0", "--device", "cpu", "--logs", str(tmp_path / "logs"),
                                 "--name", "r", "--log-every-n-steps", "1"], full=True)
    assert code == 0 and quiet(err), err[-3000:]  # > /dev/full: a logging error's traceback a line, exit 1
    assert (tmp_path / "logs" / "r" / "checkpoints" / "epoch_1.pt").is_file()
    assert "Train Epoch" in (tmp_path / "logs" / "r" / "out.log").read_text()  # the log file has it all

