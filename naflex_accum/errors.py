"""User-facing errors and the generic validators every setting goes through.

Invariant: every error a user can meet is one of these classes and its message
is one line: a ``UsageError`` names the flag or file at fault and what would be
valid (the CLI prints it and exits 2, no traceback; ``WriteError`` a run-folder
file that cannot be written; ``QuietUsageError`` another rank's copy of rank
0's, which only rank 0 prints); a ``StepError`` (and its ``ContractError``) is
the accumulation step's refusal; ``PatchError``, ``SelfCheckFailed`` and
``StartFailed`` (exit 1: upstream's ``main`` failed to start) the runner's. A
``TransientError`` is one line too, for a failure that says nothing about the
settings (storage gone mid-run, input that stopped coming): the trainer exits 74
on it, which a cluster script may retry; ``storage_gone(errno)`` says which OS
errors mean the storage went away, not that it is full or read-only. Nothing
here imports the rest of the package. ``OneLineParser`` makes argparse's own
errors (unknown flag, bad choice) follow the same rule instead of dumping the
whole usage text; ``check_int`` is the one integer validator every setting goes
through. ``last_word`` keeps the one line a
process ended with, for ``$NAFLEX_ACCUM_EXIT_FILE`` (a cluster script's job log).
"""
import argparse
import errno as _errno
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


class StepError(ValueError):
    """A bad setting or input that the accumulation step refuses, in one line.

    The step's own refusals (and the contract's, ``ContractError``) are of this class, so a runner
    can print them as one line where a traceback from inside the step would otherwise reach the user.
    """


class ContractError(StepError):
    """A task or upstream loop that does not speak the contract the step was installed for (one line)."""


class PatchError(RuntimeError):
    """The installed open_clip is not one the patch can be installed on (one line; ``upstream.patch.patch_error``
    words it)."""

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
    """``value`` if it is an int (not a bool) of at least ``minimum``; else a UsageError naming ``flag``.

    The message says "a positive integer" for ``minimum`` 1 and "an integer >= N"
    otherwise, unless ``noun`` words it.
    """
    if not is_int_at_least(value, minimum):
        noun = noun or ("a positive integer" if minimum == 1 else f"an integer >= {minimum}")
        raise UsageError(f"{flag} must be {noun}, got {value!r}")
    return value


def check_ints(args, minimum: int, *names: str) -> None:
    """``check_int`` on each ``args.NAME`` that is set, naming it as its flag (``--name-with-dashes``)."""
    for name in names:
        if getattr(args, name) is not None:
            check_int(getattr(args, name), f"--{name.replace('_', '-')}", minimum)
