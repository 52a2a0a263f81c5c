"""The run folder, open_clip's layout: ``logs/NAME/{out.log, params.txt, tensorboard/, checkpoints/}``,
``checkpoints/results.jsonl`` included.

Invariants: one live process holds a folder, through a POSIX ``lockf`` on ``logs/NAME/.lock`` (dropped when
the process dies; unlike ``flock`` not shared with forked loader workers; works over NFS); rank 0 alone
decides and every rank acts on it; the folder is created or changed only after every setting is checked, and
a refused start leaves no folder it created; nothing a user has is overwritten. docs/long-runs.md, "Resuming".
"""
import errno
import fcntl
import itertools
import logging
import os
import shutil
import socket
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Optional, Tuple

from ...errors import QuietUsageError, UsageError, WriteError, writing
from ..output.logs import setup_logging, write_params
from .checkpoint import MOST_RECENT, load_checkpoint, newest_loadable, position, remove_stale_temps
from .lineage import abandoned_folders, start_branch

log = logging.getLogger(__name__)


@dataclass
class RunPaths:
    root: Path

    def __post_init__(self):
        self.log_file, self.params_file, self.tensorboard, self.checkpoints, self.stop_file, self.lock_file = (
            self.root / name for name in ("out.log", "params.txt", "tensorboard", "checkpoints", "STOP", ".lock"))
        self.results = self.checkpoints / "results.jsonl"  # every evaluation's metrics, appended (open_clip's place)
        self.most_recent = self.checkpoints / MOST_RECENT

    def checkpoint(self, epoch: int) -> Path:
        return self.checkpoints / f"epoch_{epoch}.pt"

    def step_checkpoint(self, global_step: int) -> Path:
        return self.checkpoints / f"step_{global_step}.pt"


def on_master(world, fn, *args):
    """``fn(*args)`` on rank 0 only; every rank returns its result, or raises its ``UsageError``."""
    outcome, error = None, None
    if world.is_master:
        try:
            outcome = (True, fn(*args))
        except UsageError as exc:
            outcome, error = (False, str(exc)), exc
    ok, value = world.master_result(outcome)  # the others wait on the store while rank 0 works alone
    if ok:
        return value
    if error is not None:
        raise error
    raise QuietUsageError(value)


class RunLock:
    """An exclusive lock on the folder's ``.lock`` until ``release`` or death. Never open and close ``.lock``
    elsewhere: closing any descriptor of the file drops a POSIX lock."""

    def __init__(self, path: Path):
        self.path, self.fd = Path(path), None

    def acquire(self) -> "RunLock":
        with writing(self.path):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                raise UsageError(f"run folder {self.path.parent} is in use by another live process ({holder}); "
                                 f"wait for it to end or stop it (logs/NAME/STOP), or choose another --name") \
                    from None
            log.warning(f"{self.path}: this file system cannot lock files ({exc.strerror}); "
                        f"nothing stops a second run from using the folder at the same time")
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        self.fd = fd
        try:  # who holds it, for the message a second run prints
            os.ftruncate(fd, 0)
            os.write(fd, f"host {socket.gethostname()} pid {os.getpid()}\n".encode())
        except OSError as exc:
            self.release()
            raise WriteError(self.path, exc) from None
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # the file stays: unlinking it would race with a process about to lock it
            self.fd = None


def default_name(args) -> str:
    date = datetime.now().strftime("%Y_%m_%d-%H_%M_%S")
    model = str(args.model).replace("/", "-")
    return f"{date}-model_{model}-lr_{args.lr}-b_{args.batch_size}-j_{args.workers}-p_{args.precision}"


@dataclass
class Claim:
    """Rank 0's decision, shared: the folder, the checkpoint to resume (None: a fresh start)."""
    paths: RunPaths
    resume: Optional[Path] = None
    payload: Optional[dict] = None  # rank 0 only: the resume checkpoint, already read
    lock: Optional[RunLock] = None  # rank 0 only
    where: Optional[Tuple[int, int, int]] = None  # rank 0, --resume PATH: its position (a branch starts there)
    created: Optional[Path] = None  # rank 0: the topmost folder this start made (None: the folder was there)
    linked: Optional[Path] = None  # rank 0: the resumed file, linked into checkpoints/ (lineage)
    state: Any = None  # the run's TrainState, once built (``watch``)
    first_step: int = 0  # its global step when the training began

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()

    def watch(self, state) -> None:
        """From here on a step trained makes the folder worth keeping (its log and tensorboard tell the step)."""
        self.state, self.first_step = state, state.global_step

    def discard(self) -> None:
        """After a refused start: remove the folder this start made, unless it trained a step or saved in it."""
        paths, created = self.paths, self.created
        if created is None or not paths.root.is_dir():
            return
        trained = self.state is not None and self.state.global_step > self.first_step
        saved = paths.checkpoints.is_dir() and any(p != self.linked for p in paths.checkpoints.iterdir())
        if trained or saved:
            return
        setup_logging(None, True)  # out.log is closed before it goes (an open file cannot leave an NFS folder)
        try:
            for entry in paths.root.iterdir():
                if entry == paths.lock_file:
                    continue  # held until the rest is gone, so no other start takes the folder meanwhile
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
            self.release()
            paths.lock_file.unlink(missing_ok=True)
            paths.root.rmdir()
        except OSError as exc:
            log.warning(f"could not remove {paths.root}, made by this refused start: [Errno {exc.errno}] "
                        f"{exc.strerror} ({exc.filename})")
            return
        for parent in paths.root.parents if created != paths.root else ():
            try:
                parent.rmdir()  # made by this start too; kept if another run has put something there since
            except OSError:
                break
            if parent == created:
                break
        log.info(f"Removed {created}: this start made it and saved nothing in it")


def _not_a_folder(args, root: Path) -> UsageError:
    return UsageError(f"--logs-dir {args.logs} --name {args.name}: {root} is a file, not a folder; choose another "
                      f"--name or --logs-dir (or move the file)")


def _claim_on_master(args, claim: Claim) -> tuple:
    paths = claim.paths
    if paths.root.exists() and not paths.root.is_dir():
        raise _not_a_folder(args, paths.root)
    if args.resume is None and paths.root.exists():
        raise UsageError(f"run folder {paths.root} already exists; pass --resume latest to continue it, "
                         f"or choose another --name")
    if paths.root.is_dir():  # lock before reading (or cleaning) its checkpoints
        claim.lock = RunLock(paths.lock_file).acquire()
        for stale in remove_stale_temps(paths.checkpoints):
            log.info(f"Removed {stale}, left by a save that never finished")
    if args.resume == "latest":
        claim.resume, claim.payload = newest_loadable(paths.checkpoints)
        abandoned = abandoned_folders(paths.checkpoints)
        if claim.resume is None and abandoned:  # the run is not new: never restart it from scratch
            raise UsageError(f"--resume latest: {paths.checkpoints} holds no loadable checkpoint of the current "
                             f"branch, only abandoned ones (in {', '.join(p.name for p in abandoned)}/); resume "
                             f"one of them with --resume PATH")
    elif args.resume is not None:
        claim.resume, claim.payload = Path(args.resume), load_checkpoint(args.resume)
        claim.where = position(claim.payload, f"--resume {args.resume}")
    return args.name, (str(claim.resume) if claim.resume else None)


def claim_run(args, world) -> Claim:
    """Rank 0 names the run, locks an existing folder, removes stale temporary files and picks the checkpoint."""
    if world.is_master and args.name is None:
        args.name = default_name(args)
    claim = Claim(RunPaths(Path(args.logs) / str(args.name)))
    try:
        args.name, resume = on_master(world, _claim_on_master, args, claim)
    except UsageError:
        claim.release()
        raise
    claim.paths = RunPaths(Path(args.logs) / args.name)
    claim.resume = Path(resume) if resume else None
    return claim


def _first_missing(folder: Path) -> Optional[Path]:
    """The topmost of ``folder`` and its parents that does not exist: what ``mkdir(parents=True)`` makes."""
    missing = None
    for f in [folder, *folder.parents]:
        if f.exists():
            break
        missing = f
    return missing


def _params_path(paths: RunPaths, claim: Claim) -> Path:
    """``params.txt``, or for a resume a ``params-resume-STEM[-N].txt`` that does not exist yet."""
    if not paths.params_file.exists():
        return paths.params_file
    stem = claim.resume.stem if claim.resume else "fresh"
    for n in itertools.count(1):
        path = paths.root / f"params-resume-{stem}{'' if n == 1 else f'-{n}'}.txt"
        if not path.exists():
            return path


def _create_on_master(claim: Claim, args) -> None:
    paths = claim.paths
    created = _first_missing(paths.root)
    try:
        paths.root.mkdir(parents=True, exist_ok=args.resume is not None)
        claim.created = created
        paths.checkpoints.mkdir(exist_ok=True)
    except FileExistsError:
        if paths.root.exists() and not paths.root.is_dir():
            raise _not_a_folder(args, paths.root) from None
        raise UsageError(f"run folder {paths.root} already exists (made by another run just now); "
                         f"choose another --name") from None
    except OSError as exc:
        raise WriteError(exc.filename or paths.root, exc) from None
    if claim.lock is None:
        claim.lock = RunLock(paths.lock_file).acquire()
    write_params(_params_path(paths, claim), args)
    setup_logging(paths.log_file, True)
    if claim.where is not None:
        claim.linked = start_branch(paths.checkpoints, claim.resume, claim.where).linked


def create_run_folder(claim: Claim, args, world) -> None:
    """Rank 0 makes (or, under --resume, reuses) the folder, locks it, writes params.txt, logs to out.log from
    here on, and starts a branch when resuming an earlier checkpoint; errors reach every rank."""
    on_master(world, _create_on_master, claim, args)
