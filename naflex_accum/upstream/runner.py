"""Run upstream open_clip main's trainer with the fixed accumulation step installed.

    python -m naflex_accum.openclip ARGS...
    torchrun --nproc-per-node 8 -m naflex_accum.openclip ARGS...
    naflex-accum openclip ARGS...

Invariant: ARGS reach ``open_clip_train.main.main`` unchanged, and only once
the patch is in place in this process (every torchrun rank installs its own);
an open_clip that lacks the step being replaced (3.3.0 from PyPI has no NaFlex
training), or whose contract fits no generation the fix knows, stops here with
exit 2 and one line, before any work starts. Before the run folder exists,
right after upstream sets up its process group, every rank audits the step on
this run's task (``selfcheck``; ``NAFLEX_ACCUM_VERIFY=0`` skips it) and all stop,
exit 2, if any failed. The run folder says that the fix ran, in which mode, on
which upstream (version, contract, fingerprint) and with which verdict:
``params.txt`` holds ``naflex_accum*`` entries and ``out.log`` lines from
``naflex_accum.openclip``, whatever level logging is set to. A step that
refuses its input (``scales.StepError``) ends the run with its one line, exit 2.
"""
import contextlib
import importlib
import logging
import sys
from typing import List, Optional, Sequence

from .. import __version__
from ..accum.modes import resolve_mode
from ..errors import PatchError, StepError, UsageError
from ..ranks import process_rank
from .patch import describe, patched
from .selfcheck import check_run, enabled

PROG = "naflex_accum.openclip"
UPSTREAM_MAIN = "open_clip_train.main"
RECORD_KEY = "naflex_accum"  # the params.txt entry (an attribute of upstream's parsed args)

_log = logging.getLogger("naflex_accum.openclip")  # not __main__ under python -m


def _refusal(exc) -> str:
    """One line for a PatchError: what is installed, what is missing, and the way out."""
    if exc.missing:
        return (f"open_clip_torch {exc.version} has no NaFlex training step to patch ({exc.expected} is "
                f"missing; it is in upstream open_clip main, 4.x dev): use `naflex-accum train`, which works "
                f"with any open_clip, or install open_clip from its git checkout.")
    return (f"open_clip_torch {exc.version} cannot take the fix: expected {exc.expected}, found {exc.found}. "
            f"This runner needs upstream open_clip main with NaFlex training in a contract it knows (pip install "
            f"a verified commit from its git checkout; see `naflex-accum verify`); `naflex-accum train` works with "
            f"any open_clip.")


def _exit_code(result) -> int:
    # Upstream's main returns None after training and -1 when it refuses to
    # start (an experiment name already in use, say); its own __main__ drops
    # that value, the runner turns it into a failing exit status.
    return 0 if result is None or result == 0 else 1


def _upstream_main_module():
    try:
        return importlib.import_module(UPSTREAM_MAIN)
    except ImportError as exc:
        raise UsageError(
            f"cannot import {UPSTREAM_MAIN} ({exc}); install open_clip with its training extras "
            f"(pip install '.[training]' in its git checkout).") from None


def _log_unfiltered(message: str) -> None:
    """Hand one INFO record to every root handler (upstream's out.log and console), whatever the levels.

    A run's provenance must not depend on the log level: a logger or handler
    set to WARNING would drop an ordinary INFO record.
    """

    if process_rank() != 0:
        return
    record = _log.makeRecord(_log.name, logging.INFO, __file__, 0, message, None, None)
    for handler in logging.getLogger().handlers:
        handler.handle(record)


def _checked(args, mode: str, lines: list) -> None:
    """The self-check of this run (every rank), its lines kept for out.log and said on stderr by rank 0."""
    lines.extend(check_run(args, mode))
    if process_rank() == 0:
        print("\n".join(f"naflex-accum: {text}" for text in lines[1:]), file=sys.stderr, flush=True)


@contextlib.contextmanager
def _recorded_in_run_folder(module, mode: str, line: str):
    """While upstream's ``main`` runs, check the run before it trains and make its run folder record the fix.

    Upstream's ``main`` parses its args, sets up its process group
    (``init_distributed_device``), then creates the run folder, opens ``out.log``
    (``setup_logging``) and writes ``params.txt`` from ``vars(args)``, looking
    each function up in its module at call time. Wrapping them for the run adds
    ``args.naflex_accum``, runs the self-check once the ranks can agree (on an
    upstream without that function, right after parsing), and logs the record
    right after logging is set up; an upstream without them runs unchanged (the
    install line still goes to stderr). Each is put back afterwards while it is
    still ours.
    """
    lines = [f"naflex-accum {__version__}: {line}"]
    check_in_parse = not callable(getattr(module, "init_distributed_device", None))

    def recorded_args(parse_args):
        def parse_args_recorded(*args, **kwargs):
            parsed = parse_args(*args, **kwargs)
            setattr(parsed, RECORD_KEY, f"{mode} (naflex-accum {__version__})")
            if check_in_parse:
                _checked(parsed, mode, lines)
            return parsed
        return parse_args_recorded

    def checked(init_distributed_device):
        def init_distributed_device_checked(args, *rest, **kwargs):
            device = init_distributed_device(args, *rest, **kwargs)
            _checked(args, mode, lines)
            return device
        return init_distributed_device_checked

    def logged(setup_logging):
        def setup_logging_recorded(*args, **kwargs):
            result = setup_logging(*args, **kwargs)
            for text in lines:
                _log_unfiltered(text)
            return result
        return setup_logging_recorded

    swapped = {}
    for name, wrap in (("parse_args", recorded_args), ("init_distributed_device", checked),
                       ("setup_logging", logged)):
        original = getattr(module, name, None)
        if callable(original):
            swapped[name] = (original, wrap(original))
            setattr(module, name, swapped[name][1])
    try:
        yield
    finally:
        for name, (original, wrapper) in swapped.items():
            if getattr(module, name, None) is wrapper:
                setattr(module, name, original)


def run(argv: Sequence[str]) -> int:
    """Install the patch, then hand ``argv`` to upstream's ``main``; ``UsageError`` if it cannot start."""
    mode = resolve_mode()  # $NAFLEX_ACCUM_MODE, else the default; a bad value stops here
    enabled()  # a bad $NAFLEX_ACCUM_VERIFY too
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(patched(mode=mode))
        except PatchError as exc:
            raise UsageError(_refusal(exc)) from None
        module = _upstream_main_module()
        stack.enter_context(_recorded_in_run_folder(module, mode, describe(mode)))
        try:
            return _exit_code(module.main(list(argv)))
        except StepError as exc:  # the step's own one-line refusal, raised deep inside upstream's loop
            raise UsageError(f"the accumulation step stopped the run: {' '.join(str(exc).split())}") from None


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        return run(argv)
    except UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
