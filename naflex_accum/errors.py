"""User-facing errors.

Invariant: a ``UsageError`` message is one line that names the flag or file at
fault and what would be valid; the CLI prints it and exits 2, no traceback.
``OneLineParser`` makes argparse's own errors (unknown flag, bad choice) follow
the same rule instead of dumping the whole usage text.
"""
import argparse


class UsageError(ValueError):
    pass


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one ``UsageError`` line; ``--help`` is unchanged."""

    def error(self, message):
        raise UsageError(f"{message} (see {self.prog} --help)")
