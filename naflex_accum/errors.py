"""User-facing errors and the generic validators every setting goes through; imports nothing of the package.

Invariant: every error a user can meet is one of these classes, its message one line: ``UsageError`` (exit 2,
naming the flag or file and what is valid), ``StepError``/``ContractError`` (the step's refusals), the runner's
``PatchError``, ``SelfCheckFailed``, ``StartFailed`` (exit 1), and ``TransientError`` (exit 74: storage gone,
input stopped). ``OneLineParser`` and ``check_int`` hold argparse's errors and integers to the same rule.
docs/long-runs.md, "Exit codes".
"""
import argparse
import contextlib
import errno as _errno
import os
import sys
from typing import Optional


class UsageError(ValueError):
    """A bad setting, flag or input file, in one line (the CLI prints it and exits ``exit_code``, 2)."""

    exit_code = 2


class StartFailed(UsageError):
    """Upstream's ``main`` stopped before its first step, in one line (the runner prints it and exits 1)."""

    exit_code = 1


class QuietUsageError(UsageError):
    """Rank 0's ``UsageError``, raised again on the other ranks so they exit 2 too; only rank 0 prints it."""


class WriteError(UsageError):
    """A file of the run folder could not be written (full disk, no permission, ...); ``errno``: the OS error's
    (``storage_gone`` tells the storage that went away, exit 74, from a setting to fix, exit 2)."""

    def __init__(self, path, exc: OSError):
        reason = f"[Errno {exc.errno}] {exc.strerror}" if exc.errno else str(exc)
        super().__init__(f"cannot write {path}: {reason}")
        self.errno = exc.errno


@contextlib.contextmanager
def writing(path):
    """An ``OSError`` in the block becomes the ``WriteError`` naming ``path``."""
    try:
        yield
    except OSError as exc:
        raise WriteError(path, exc) from None


class StepError(ValueError):
    """A bad setting or input the step (or its contract) refuses in one line, which a runner prints, not a traceback."""


class ContractError(StepError):
    """A task or upstream loop that does not speak the contract the step was installed for (one line)."""


class PatchError(RuntimeError):
    """The installed open_clip is not one the patch can be installed on (``upstream.patch.patch_error``)."""

    def __init__(self, message: str, version: str, found: str, expected: str, missing: bool):
        self.version, self.expected, self.found, self.missing = version, expected, found, missing
        super().__init__(message)


class SelfCheckFailed(UsageError):
    """The installed step failed its audit on this run's task (one line; the runner exits 2)."""


_LAST_WORD = [""]


def last_word(line: Optional[str] = None) -> str:
    """The one line this process ends with (``line`` sets it and is returned): the CLI writes it to
    ``$NAFLEX_ACCUM_EXIT_FILE`` under the exit status, and launch/slurm.sbatch prints it in the job log."""
    if line is not None:
        _LAST_WORD[0] = line
    return _LAST_WORD[0]


EXIT_FILE_ENV = "NAFLEX_ACCUM_EXIT_FILE"


def record_exit(code: int, line: str = "") -> None:
    """Writes ``code``, and ``line`` under it, to ``$NAFLEX_ACCUM_EXIT_FILE`` when set: torchrun exits 1 whatever
    its workers' status, so a cluster script that requeues on 74 reads the trainer's own class there."""
    path = os.environ.get(EXIT_FILE_ENV)
    if not path:
        return
    tmp = f"{path}.{os.getpid()}"
    try:  # every rank of a job writes the same class (train.ending.liveness); the last replace stands
        with open(tmp, "w") as f:
            f.write(f"{code}\n{line}\n" if code else f"{code}\n")
        os.replace(tmp, path)
    except OSError as exc:
        print(f"naflex-accum: cannot write the exit status to ${EXIT_FILE_ENV}={path} ({exc})", file=sys.stderr)


def first_line(exc: BaseException, named: bool = False) -> str:
    """``exc``'s message in one line (its first, at most 200 characters; its class when it has none), after its
    class's name when ``named``."""
    text = next((line.strip()[:200] for line in str(exc).splitlines() if line.strip()), "")
    return f"{type(exc).__name__}: {text}" if named else text or type(exc).__name__


def is_int_at_least(value, minimum: int) -> bool:
    # bool is an int subclass; a True batch size is a bug, not a 1.
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def is_positive_int(value) -> bool:
    return is_int_at_least(value, 1)


class TransientError(Exception):
    """A failure of the input or of the storage that a later attempt may not meet: one line, exit 74."""


# Errors of storage that went away (an NFS server, a FUSE mount, a network disk): a file that was there is not
# (ENOENT), a stale handle, I/O errors and timeouts; not ENOSPC, EACCES, EROFS, EDQUOT: those need a person
_GONE = ("ENOENT", "ESTALE", "EIO", "ENOTCONN", "ETIMEDOUT", "ENODEV", "ENXIO", "EHOSTDOWN", "EHOSTUNREACH",
         "ECONNRESET", "ECONNABORTED", "ECONNREFUSED", "ENETDOWN", "ENETUNREACH", "ENETRESET", "ENOLINK", "ECOMM",
         "EREMOTEIO")
STORAGE_GONE = frozenset(getattr(_errno, name) for name in _GONE if hasattr(_errno, name))


def storage_gone(errno: Optional[int]) -> bool:
    return errno in STORAGE_GONE


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one ``UsageError`` line; ``--help`` is unchanged."""

    def error(self, message):
        raise UsageError(f"{message} (see {self.prog} --help)")


def check_int(value, flag: str, minimum: int = 1, noun: Optional[str] = None) -> int:
    """``value`` if it is an int (not a bool) of at least ``minimum``; else a UsageError naming ``flag`` ("a
    positive integer", "an integer >= N", or ``noun``)."""
    if not is_int_at_least(value, minimum):
        noun = noun or ("a positive integer" if minimum == 1 else f"an integer >= {minimum}")
        raise UsageError(f"{flag} must be {noun}, got {value!r}")
    return value


def check_ints(args, minimum: int, *names: str) -> None:
    """``check_int`` on each ``args.NAME`` that is set, naming it as its flag (``--name-with-dashes``)."""
    for name in names:
        if getattr(args, name) is not None:
            check_int(getattr(args, name), f"--{name.replace('_', '-')}", minimum)
