"""Put first on PYTHONPATH by tests/integration/test_slurm.py for the jobs it submits; acts only in a trainer
process (``python -m naflex_accum.train`` or ``-m naflex_accum.openclip``, under torchrun or srun) and only with
``NAFLEX_TEST_RECORD`` set.

- The built-in trainer records every batch the loop takes, one JSON line ``[epoch, index, keys]`` a batch, in
  ``$NAFLEX_TEST_RECORD-<restart>-rank<R>.jsonl`` (restart: ``$SLURM_RESTART_COUNT``).
- ``NAFLEX_TEST_PAUSE=RESTART:EPOCH:INDEX[,...]``: in that start, rank 0 writes ``$NAFLEX_TEST_RECORD-paused-RESTART``
  before it takes batch INDEX of EPOCH (upstream's trainer: before it starts EPOCH) and waits (at most 120 s)
  until the run folder's STOP file or ``$NAFLEX_TEST_RECORD-release-RESTART`` exists, so that the test's signal
  lands inside a known step.
"""
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

PREFIX = os.environ.get("NAFLEX_TEST_RECORD", "")
RESTART = os.environ.get("SLURM_RESTART_COUNT", "0")
RANK = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


def _module() -> str:
    argv = getattr(sys, "orig_argv", [])
    return argv[argv.index("-m") + 1] if "-m" in argv[:-1] else ""


def _pause_at():
    pauses = [p.split(":") for p in os.environ.get("NAFLEX_TEST_PAUSE", "").split(",") if p]
    return next(([int(x) for x in p[1:]] for p in pauses if p[0] == RESTART and RANK == 0), None)


def _pause() -> None:
    Path(f"{PREFIX}-paused-{RESTART}").touch()
    stop = Path(os.environ.get("LOGS", "logs")) / os.environ.get("NAME", "") / "STOP"
    release, deadline = Path(f"{PREFIX}-release-{RESTART}"), time.monotonic() + 120
    while not (stop.exists() or release.exists()) and time.monotonic() < deadline:
        time.sleep(0.05)


def _builtin() -> None:
    from naflex_accum.data import loader

    records, pause_at, real = Path(f"{PREFIX}-{RESTART}-rank{RANK}.jsonl"), _pause_at(), loader.TrainLoader.iter_meta

    def iter_meta(self):
        for batch, meta in real(self):
            if pause_at == [self.epoch, meta["index"]]:
                _pause()
            with records.open("a") as f:
                f.write(json.dumps([self.epoch, meta["index"], meta["keys"]]) + "\n")
            yield batch, meta

    loader.TrainLoader.iter_meta = iter_meta


class _UpstreamTrain:
    """Wraps upstream's ``open_clip_train.train.train_one_epoch`` once the runner imports it (before its main
    module binds the name), without importing anything of upstream here."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "open_clip_train.train":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        real_exec, pause_at = spec.loader.exec_module, _pause_at()

        def exec_module(module):
            real_exec(module)
            real = module.train_one_epoch

            def train_one_epoch(state, *args, **kwargs):
                if pause_at is not None and state.epoch == pause_at[0]:
                    _pause()
                return real(state, *args, **kwargs)

            module.train_one_epoch = train_one_epoch

        spec.loader.exec_module = exec_module
        return spec


if PREFIX and _module() == "naflex_accum.train":
    _builtin()
elif PREFIX and _module() == "naflex_accum.openclip":
    sys.meta_path.insert(0, _UpstreamTrain())
