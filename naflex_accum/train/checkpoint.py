"""Run folders and checkpoints in open_clip's layout: ``logs/NAME/{out.log, params.txt, tensorboard/, checkpoints/epoch_K.pt}``.

Invariants: a checkpoint file is either the old one or the complete new one
(written to a temporary file in the same folder, then ``os.replace``d); an
existing run folder is never reused without ``--resume``; ``--resume latest``
picks the newest state (``epoch_latest.pt`` from a stop inside an epoch, else
the highest ``epoch_K.pt``) and starts fresh only when the run has none.
"""
import os
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Optional

import torch

from ..errors import UsageError

CHECKPOINT_RE = re.compile(r"^epoch_(\d+)\.pt$")
# Written when a run is asked to stop inside an epoch; removed once a later
# epoch checkpoint exists, so when present it is the newest state.
MID_EPOCH_NAME = "epoch_latest.pt"


@dataclass
class RunPaths:
    root: Path

    @property
    def log_file(self) -> Path:
        return self.root / "out.log"

    @property
    def params_file(self) -> Path:
        return self.root / "params.txt"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def checkpoint(self, epoch: int) -> Path:
        return self.checkpoints / f"epoch_{epoch}.pt"

    @property
    def mid_epoch(self) -> Path:
        return self.checkpoints / MID_EPOCH_NAME

    @property
    def stop_file(self) -> Path:
        return self.root / "STOP"


def default_name(args) -> str:
    date = datetime.now().strftime("%Y_%m_%d-%H_%M_%S")
    model = str(args.model).replace("/", "-")
    return f"{date}-model_{model}-lr_{args.lr}-b_{args.batch_size}-j_{args.workers}-p_{args.precision}"


def latest_checkpoint(folder: Path) -> Optional[Path]:
    if not folder.is_dir():
        return None
    if (folder / MID_EPOCH_NAME).is_file():
        return folder / MID_EPOCH_NAME
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := CHECKPOINT_RE.match(p.name))]
    return max(found)[1] if found else None


def resolve_run(args) -> tuple:
    """``(RunPaths, checkpoint to resume or None)``; refuses to reuse a run folder without ``--resume``."""
    if args.name is None:
        args.name = default_name(args)
    paths = RunPaths(Path(args.logs) / args.name)
    if args.resume is None:
        if paths.root.exists():
            raise UsageError(f"run folder {paths.root} already exists; pass --resume latest to continue it, "
                             f"or choose another --name")
        return paths, None
    if args.resume == "latest":
        return paths, latest_checkpoint(paths.checkpoints)
    resume = Path(args.resume)
    if not resume.is_file():
        raise UsageError(f"--resume {args.resume}: no such checkpoint file (or use --resume latest)")
    return paths, resume


def save_checkpoint(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        torch.save(payload, tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def load_checkpoint(path: Path) -> dict:
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # a truncated or foreign file: say which, not a pickle traceback
        raise UsageError(f"--resume {path}: cannot read this checkpoint ({type(exc).__name__}: {exc})") from None
    missing = [k for k in ("epoch", "state_dict", "optimizer") if k not in checkpoint]
    if missing:
        raise UsageError(f"--resume {path}: not a naflex-accum/open_clip training checkpoint (missing {missing})")
    return checkpoint
