"""The run folder, open_clip's layout: ``logs/NAME/{out.log, params.txt, tensorboard/, checkpoints/}``.

Invariants: one live process (rank 0 of one run) holds a folder at a time,
through an exclusive POSIX lock (``fcntl.lockf``) on ``logs/NAME/.lock`` that
the kernel drops when the process dies, so a second run with the same name
exits 2 and a run killed with -9 leaves nothing that blocks its restart (a
POSIX lock, unlike ``flock``, is not shared with the data-loader workers the
process forks, and works over NFS); an existing folder is
never reused without ``--resume``; rank 0 alone decides (name, checkpoint to
resume, folder errors) and every rank acts on its decision; the folder is
created only after every setting has been checked.
"""
import errno
import fcntl
import logging
import os
import socket
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Optional

from ..errors import UsageError
from .checkpoint import MOST_RECENT, WriteError, load_checkpoint, newest_loadable, remove_stale_temps

log = logging.getLogger("naflex_accum")


class QuietUsageError(UsageError):
    """Rank 0's error, raised again on the other ranks so they exit 2 too; only rank 0 prints it."""


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

    def step_checkpoint(self, global_step: int) -> Path:
        return self.checkpoints / f"step_{global_step}.pt"

    @property
    def most_recent(self) -> Path:
        return self.checkpoints / MOST_RECENT

    @property
    def stop_file(self) -> Path:
        return self.root / "STOP"

    @property
    def lock_file(self) -> Path:
        return self.root / ".lock"


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
    """An exclusive lock on the folder's ``.lock``, held until ``release`` or the process's death.

    The process must not open and close ``.lock`` elsewhere: closing any descriptor of the file drops a
    POSIX lock."""

    def __init__(self, path: Path):
        self.path, self.fd = Path(path), None

    def acquire(self) -> "RunLock":
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise WriteError(self.path, exc) from None
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

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()


def _claim_on_master(args, claim: Claim) -> tuple:
    paths = claim.paths
    if args.resume is None and paths.root.exists():
        raise UsageError(f"run folder {paths.root} already exists; pass --resume latest to continue it, "
                         f"or choose another --name")
    if paths.root.is_dir():  # lock before reading (or cleaning) its checkpoints
        claim.lock = RunLock(paths.lock_file).acquire()
        for stale in remove_stale_temps(paths.checkpoints):
            log.info(f"Removed {stale}, left by a save that never finished")
    if args.resume == "latest":
        claim.resume, claim.payload = newest_loadable(paths.checkpoints)
    elif args.resume is not None:
        claim.resume, claim.payload = Path(args.resume), load_checkpoint(args.resume)
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


def _create_on_master(claim: Claim, args) -> None:
    from .logs import write_params

    paths = claim.paths
    try:
        paths.root.mkdir(parents=True, exist_ok=args.resume is not None)
        paths.checkpoints.mkdir(exist_ok=True)
    except FileExistsError:
        raise UsageError(f"run folder {paths.root} already exists (made by another run just now); "
                         f"choose another --name") from None
    except OSError as exc:
        raise WriteError(exc.filename or paths.root, exc) from None
    if claim.lock is None:
        claim.lock = RunLock(paths.lock_file).acquire()
    params = paths.params_file if not paths.params_file.exists() else \
        paths.root / f"params-resume-{claim.resume.stem if claim.resume else 'fresh'}.txt"
    write_params(params, args)


def create_run_folder(claim: Claim, args, world) -> None:
    """Rank 0 makes (or, under --resume, reuses) the folder, locks it and writes params.txt; errors reach every rank."""
    on_master(world, _create_on_master, claim, args)
