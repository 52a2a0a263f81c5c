"""The ``naflex-accum`` console script: one subcommand per module in ``naflex_accum.commands``.

Invariant: a bad input exits 2 with one ``naflex-accum <cmd>: error: ...`` line
and no traceback, Ctrl-C one ``naflex-accum <cmd>: interrupted`` line and exit
130 (``interrupt``); subcommand modules are imported only when chosen, so
``naflex-accum --help`` stays fast and nothing is patched by merely running it.
Importing this module sets up Ctrl-C (``interrupt.install``, which leaves a
handler someone else set alone): the console script imports it first thing,
and its first statement does it, so that a Ctrl-C during any of the imports
is the same one line (the window left is Python's own start-up).
"""
try:  # first (see the module docstring)
    from .interrupt import finished, install as install_interrupt, interrupted

    install_interrupt()
    import argparse
    import importlib
    import os
    import sys
    from typing import List, Optional

    from . import __version__, output
    from .errors import UsageError, last_word
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
    try:
        module = _module(name)  # torch and the rest: a Ctrl-C while they load is the same one line
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


EXIT_FILE_ENV = "NAFLEX_ACCUM_EXIT_FILE"


def entry(argv: Optional[List[str]] = None) -> int:
    """``main`` for a process that ends with the command (the console script, ``python -m``).

    Ctrl-C is one line and exit 130 at any moment (``interrupt``, set up before the command's imports); a
    reader of its output that goes away (``| head``) ends nothing (``output``). With
    ``$NAFLEX_ACCUM_EXIT_FILE`` set, the exit status is also written there, with the one line the process
    ended with under it: torchrun exits 1 whatever status its workers had, and a cluster script that requeues
    on 74 reads the trainer's own from the file, and prints the line in its job log.
    """
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
            lines = str(exc).strip().splitlines()
            last_word(f"{type(exc).__name__}: {lines[0] if lines else ''} (a bug: the traceback is in the output)")
        raise
    finally:
        finished()
        output.flush()
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
