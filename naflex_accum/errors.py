"""User-facing errors.

Invariant: a ``UsageError`` message is one line that names the flag or file at
fault and what would be valid; the CLI prints it and exits 2, no traceback.
``OneLineParser`` makes argparse's own errors (unknown flag, bad choice) follow
the same rule instead of dumping the whole usage text; ``check_int`` is the one
integer validator every setting goes through.
"""
import argparse
from typing import Optional

from .scales import is_int_at_least


class UsageError(ValueError):
    pass


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
