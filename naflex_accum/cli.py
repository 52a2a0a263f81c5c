"""The ``naflex-accum`` console script: one subcommand per module in ``naflex_accum.commands``.

Invariant: a bad input exits 2 with one ``naflex-accum <cmd>: error: ...`` line, Ctrl-C one ``interrupted``
line and exit 130; subcommand modules are imported only when chosen. Importing this module sets up Ctrl-C
(``interrupt.install``) first thing, so a Ctrl-C during any import is that one line too.
"""
from __future__ import annotations  # annotations run no code: a Ctrl-C after the try below lands in no typing call

try:  # first (see the module docstring)
    from .interrupt import finished, install as install_interrupt, interrupted, loading, quiet_fd_sharing_errors

    install_interrupt()
    import argparse
    import importlib
    import re
    import sys
    from typing import List, Optional

    from . import __version__, output
    from .errors import UsageError, first_line, last_word, record_exit
    # pip's console script compiles this between this import and entry(), where a Ctrl-C is a traceback: cached
    re.compile(r"(-script\.pyw|\.exe)?$")
except KeyboardInterrupt:
    import sys  # built in: loaded before any code runs

    _command = sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else ""
    if getattr(getattr(sys.modules.get("__main__"), "__spec__", None), "name", "") == "naflex_accum.train.__main__":
        _command = "train"  # python -m naflex_accum.train ARGS
    print(f"naflex-accum {_command}".rstrip() + ": interrupted", file=sys.stderr, flush=True)
    exec("pass")  # as interrupt.interrupted does, which may not be imported yet
    raise SystemExit(130) from None

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


def _prog(argv) -> str:
    """The name a one-line message begins with: ``naflex-accum COMMAND``, or ``naflex-accum`` before one."""
    return f"naflex-accum {argv[0]}" if argv and argv[0] in COMMANDS else "naflex-accum"


def _module(name: str):
    return importlib.import_module(f"naflex_accum.commands.{COMMANDS[name][0]}")


def _load(name: str, ends_process: bool):
    """The command's module (torch and the rest); in a process of its own a Ctrl-C while it loads ends it."""
    if not ends_process:
        return _module(name)
    prog = f"naflex-accum {name}"
    with loading(prog, lambda code: record_exit(code, last_word(f"{prog}: interrupted"))):
        return _module(name)


def main(argv: Optional[List[str]] = None, ends_process: bool = False) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="naflex-accum", description="Exact, split-invariant gradient accumulation "
                                     "for OpenCLIP NaFlex CLIP and SigLIP training.")
    parser.add_argument("--version", action="version", version=f"naflex-accum {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] not in COMMANDS:
        parser.parse_args(argv or ["--help"])
        return 2
    name, rest = argv[0], argv[1:]
    try:
        module = _load(name, ends_process)  # torch and the rest: a Ctrl-C while they load is the same one line
        quiet_fd_sharing_errors()
        code = int(module.main(rest, prog=f"naflex-accum {name}", ends_process=ends_process) or 0)
        if ends_process:
            finished()  # from here on a Ctrl-C changes nothing
        return code
    except UsageError as exc:
        print(last_word(f"naflex-accum {name}: error: {exc}"), file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        last_word(f"naflex-accum {name}: interrupted")
        return interrupted(f"naflex-accum {name}")


def entry(argv: Optional[List[str]] = None) -> int:
    """``main`` for a process that ends with the command: Ctrl-C is one line and exit 130 (``interrupt``); a
    closed reader (``| head``) ends nothing; ``$NAFLEX_ACCUM_EXIT_FILE`` gets the status and the last line
    (torchrun exits 1 whatever its workers' status, and a requeue on 74 reads the trainer's own)."""
    install_interrupt()
    code = 1  # what an exception leaving here means
    last_word("")
    try:
        output.install()  # | head: the command goes on to its own end and status (``output``)
        code = main(argv, ends_process=True)  # a scheduler's SIGTERM after a run has saved must not kill it
        return code
    except KeyboardInterrupt:  # before main's own try (its parser): the same one line
        code = interrupted(_prog(sys.argv[1:] if argv is None else argv))
        return code
    except Exception as exc:  # a bug: its traceback follows on stderr
        if not last_word():
            last_word(f"{first_line(exc, named=True)} (a bug: the traceback is in the output)")
        raise
    finally:
        finished()
        output.flush()
        record_exit(code, last_word())


if __name__ == "__main__":
    try:  # a Ctrl-C as entry() starts, before its own try
        sys.exit(entry())
    except KeyboardInterrupt:
        sys.exit(interrupted(_prog(sys.argv[1:])))
