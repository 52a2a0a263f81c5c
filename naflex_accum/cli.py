"""The ``naflex-accum`` console script: one subcommand per module in ``naflex_accum.commands``.

Invariant: a bad input exits 2 with one ``naflex-accum <cmd>: error: ...`` line
and no traceback; subcommand modules are imported only when chosen, so
``naflex-accum --help`` stays fast and nothing is patched by merely running it.
"""
import argparse
import importlib
import os
import sys
from typing import List, Optional

from . import __version__
from .errors import UsageError, last_word

# name -> (module under naflex_accum.commands, one-line help)
COMMANDS = {
    "demo": ("demo", "make the demo data if needed and train the tiny model on the CPU (~2 min)"),
    "train": ("train", "train a NaFlex CLIP/SigLIP on webdataset shards (open_clip flag names)"),
    "make-demo-data": ("make_demo_data", "write synthetic image-caption webdataset shards"),
    "openclip": ("runner", "run upstream open_clip main's trainer with the fixed step installed"),
    "export": ("export", "write a checkpoint's model for open_clip (local-dir:) and its image tower for timm"),
    "verify": ("verify", "audit split invariance of the step training would use, on this install"),
    "table": ("table", "print the full split-invariance table (docs/equivalence.md)"),
}


def _module(name: str):
    return importlib.import_module(f"naflex_accum.commands.{COMMANDS[name][0]}")


def main(argv: Optional[List[str]] = None, ends_process: bool = False) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="naflex-accum", description="Exact, split-invariant gradient accumulation "
                                     "for OpenCLIP NaFlex CLIP and SigLIP training.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] not in COMMANDS:
        parser.parse_args(argv or ["--help"])
        return 2
    name, rest = argv[0], argv[1:]
    module = _module(name)
    try:
        return int(module.main(rest, prog=f"naflex-accum {name}", ends_process=ends_process) or 0)
    except UsageError as exc:
        print(last_word(f"naflex-accum {name}: error: {exc}"), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(last_word(f"naflex-accum {name}: interrupted"), file=sys.stderr)
        return 130


EXIT_FILE_ENV = "NAFLEX_ACCUM_EXIT_FILE"


def entry(argv: Optional[List[str]] = None) -> int:
    """``main`` for a process that ends with the command (the console script, ``python -m``).

    With ``$NAFLEX_ACCUM_EXIT_FILE`` set, the exit status is also written there, with the one line the process
    ended with under it: torchrun exits 1 whatever status its workers had, and a cluster script that requeues
    on 74 reads the trainer's own from the file, and prints the line in its job log.
    """
    code = 1  # what an exception leaving here means
    last_word("")
    try:
        code = main(argv, ends_process=True)  # a scheduler's SIGTERM after a run has saved must not kill it
        return code
    except Exception as exc:  # a bug: its traceback follows on stderr
        if not last_word():
            lines = str(exc).strip().splitlines()
            last_word(f"{type(exc).__name__}: {lines[0] if lines else ''} (a bug: the traceback is in the output)")
        raise
    finally:
        _record_exit(code)


def _record_exit(code: int) -> None:
    path = os.environ.get(EXIT_FILE_ENV)
    if not path:
        return
    tmp = f"{path}.{os.getpid()}"
    try:  # every rank of a job writes the same class (train.peers); the last replace stands
        with open(tmp, "w") as f:
            f.write(f"{code}\n{last_word()}\n" if code else f"{code}\n")
        os.replace(tmp, path)
    except OSError as exc:
        print(f"naflex-accum: cannot write the exit status to ${EXIT_FILE_ENV}={path} ({exc})", file=sys.stderr)


def _version() -> str:
    return f"naflex-accum {__version__}"


if __name__ == "__main__":
    sys.exit(entry())
