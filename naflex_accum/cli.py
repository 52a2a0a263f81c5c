"""The ``naflex-accum`` console script: one subcommand per module in ``naflex_accum.commands``.

Invariant: a bad input exits 2 with one ``naflex-accum <cmd>: error: ...`` line
and no traceback; subcommand modules are imported only when chosen, so
``naflex-accum --help`` stays fast and nothing is patched by merely running it.
"""
import argparse
import importlib
import sys
from typing import List, Optional

from . import __version__
from .errors import UsageError

# name -> (module under naflex_accum.commands, one-line help)
COMMANDS = {
    "demo": ("demo", "make the demo data if needed and train the tiny model on the CPU (~2 min)"),
    "train": ("train", "train a NaFlex CLIP/SigLIP on webdataset shards (open_clip flag names)"),
    "make-demo-data": ("make_demo_data", "write synthetic image-caption webdataset shards"),
    "openclip": ("runner", "run upstream open_clip main's trainer with the fixed step installed"),
    "verify": ("verify", "audit split invariance of the step training would use, on this install"),
    "table": ("table", "print the full split-invariance table (docs/equivalence.md)"),
}


def _module(name: str):
    return importlib.import_module(f"naflex_accum.commands.{COMMANDS[name][0]}")


def main(argv: Optional[List[str]] = None) -> int:
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
        return int(module.main(rest, prog=f"naflex-accum {name}") or 0)
    except UsageError as exc:
        print(f"naflex-accum {name}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"naflex-accum {name}: interrupted", file=sys.stderr)
        return 130


def entry(argv: Optional[List[str]] = None) -> int:
    """``main`` for a process that ends with the command (the console script, ``python -m``)."""
    from .train.preempt import exits_after_run

    exits_after_run()  # a scheduler's SIGTERM after a run has saved must not kill it during teardown
    return main(argv)


def _version() -> str:
    return f"naflex-accum {__version__}"


if __name__ == "__main__":
    sys.exit(entry())
