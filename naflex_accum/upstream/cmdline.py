"""The runner's command line: upstream's own parser under the runner's name, its refusals in one line.

Invariant: the runner's flags are upstream's, parsed by upstream's ``parse_args`` under the runner's name;
``--help`` adds the runner's environment variables; a rejected argument is one ``UsageError`` line.
"""
import contextlib
import io
import os
import sys
from typing import Callable, Optional, Sequence

from ..accum.modes import ACCUM_MODES, DEFAULT_MODE, ENV_VAR as MODE_VAR
from ..errors import EXIT_FILE_ENV as EXIT_FILE_VAR, UsageError
from .selfcheck import ENV_VAR as VERIFY_VAR

DOCS = "docs/upstream.md"


def epilog(prog: str) -> str:
    """What ``--help`` adds after upstream's flags: what the runner is, and its variables."""
    variables = [
        (f"{MODE_VAR}={'|'.join(ACCUM_MODES)}", f"accumulation mode (default {DEFAULT_MODE})"),
        (f"{VERIFY_VAR}=1|0", "1 (default): audit the step on this run's task before training; 0: skip"),
        (f"{EXIT_FILE_VAR}=PATH", "naflex-accum openclip only: also write the exit status to PATH"),
    ]
    width = max(len(name) for name, _ in variables)
    return "\n".join([
        "",
        f"{prog}: upstream open_clip main's trainer (the flags above are upstream's)",
        "with its _train_step_eager replaced by naflex-accum's fixed accumulation step. Settings",
        f"upstream would crash on are refused before anything is created (exit 2); see {DOCS}.",
        "",
        "environment variables:",
        *(f"  {name.ljust(width)}  {text}" for name, text in variables),
    ])


def _quiet_stdout() -> None:
    """``--help | head``: the reader has gone, so the rest goes nowhere instead of ending in a traceback."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _argparse_error(text: str) -> str:
    """The message of argparse's ``PROG: error: MESSAGE`` line, without its usage dump."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    last = lines[-1] if lines else "upstream's parser refused the arguments"
    return last.split(": error: ", 1)[-1]


@contextlib.contextmanager
def _named(prog: str):
    """argparse names itself after ``sys.argv[0]``; upstream's ``parse_args`` takes no name, so lend it one."""
    saved = list(sys.argv)
    sys.argv[:] = [prog, *saved[1:]]
    try:
        yield
    finally:
        sys.argv[:] = saved


def parse(parse_args: Callable, argv: Sequence[str], prog: str) -> Optional[object]:
    """Upstream's parsed ``argv``; None when ``--help`` was printed (the epilog included); ``UsageError`` if refused."""
    err = io.StringIO()
    try:
        with _named(prog), contextlib.redirect_stderr(err):
            args = parse_args(list(argv))
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise UsageError(_argparse_error(err.getvalue())) from None
        try:
            print(epilog(prog), flush=True)
        except BrokenPipeError:
            _quiet_stdout()
        return None
    except BrokenPipeError:  # in upstream's own help
        _quiet_stdout()
        return None
    except ValueError as exc:  # upstream's checks after parsing name the flag themselves
        raise UsageError(" ".join(str(exc).split())) from None
    sys.stderr.write(err.getvalue())  # whatever upstream's parser said on its way (warnings), as it said it
    return args
