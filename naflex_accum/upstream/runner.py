"""Run upstream open_clip main's trainer with the fixed accumulation step installed.

    python -m naflex_accum.openclip ARGS...
    torchrun --nproc-per-node 8 -m naflex_accum.openclip ARGS...
    naflex-accum openclip ARGS...

Invariant: ARGS reach ``open_clip_train.main.main`` unchanged, and only once
the patch is in place in this process (every torchrun rank installs its own);
an open_clip that lacks the step being replaced (3.3.0 from PyPI has no NaFlex
training), or whose contract fits no generation the fix knows, stops here with
exit 2 and one line, before any work starts. So does a run that upstream's
``main`` would crash on or silently mistrain (``preflight``, on upstream's own
parsed ARGS, ``cmdline``): nothing is created, nothing is recorded. Right
after upstream sets up its process group, before the run folder exists, every
rank audits the step on this run's task (``selfcheck``; ``NAFLEX_ACCUM_VERIFY=0``
skips it) and all stop, exit 2, if any failed; a run whose loop never calls the
step (``preflight.step_use``) is not audited and records why. The run folder
says that the fix ran, in which mode, on which upstream (version, contract,
fingerprint) and with which verdict: ``params.txt`` holds ``naflex_accum*``
entries and ``out.log`` lines from ``naflex_accum.openclip``, whatever level
logging is set to; each line reaches stderr once. A step that refuses its input
(``scales.StepError``) ends the run with its one line, exit 2. A start that
fails before its first step says upstream's error in one line, exit 1, and
takes back only what it provably made in its run folder (``startup``); a later
failure is upstream's own.
"""
import contextlib
import importlib
import logging
import sys
from typing import List, Optional, Sequence

from .. import __version__
from ..accum.modes import resolve_mode
from ..errors import PatchError, QuietUsageError, StartFailed, StepError, UsageError
from ..openclip import PROG  # the name its one-line messages begin with
from ..ranks import process_rank
from . import cmdline, preflight
from .patch import TARGET_NAME, describe, gate, import_target, is_ours, patched
from .selfcheck import check_run, enabled, record_unused
from .startup import StartWatch

USAGE_PROG = "python -m naflex_accum.openclip"  # the name --help shows
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


def _is_console(handler) -> bool:
    return (isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)
            and getattr(handler, "stream", None) in (sys.stderr, sys.stdout, sys.__stderr__, sys.__stdout__))


def _log_unfiltered(message: str) -> None:
    """Hand one INFO record to every root handler but the console (upstream's out.log), whatever the levels.

    A run's provenance must not depend on the log level: a logger or handler
    set to WARNING would drop an ordinary INFO record. The console already
    had each line on stderr, when it was new.
    """

    if process_rank() != 0:
        return
    record = _log.makeRecord(_log.name, logging.INFO, __file__, 0, message, None, None)
    for handler in logging.getLogger().handlers:
        if not _is_console(handler):
            handler.handle(record)


def _checked(args, mode: str, lines: list, use: preflight.StepUse) -> None:
    """The self-check of this run (every rank), its lines kept for out.log and said on stderr by rank 0.

    A run whose loop never calls the step is not audited: its record says so, and why."""
    lines.extend(check_run(args, mode) if use.used else record_unused(args, use.why))
    if process_rank() == 0:
        print("\n".join(f"naflex-accum: {text}" for text in lines[1:]), file=sys.stderr, flush=True)


@contextlib.contextmanager
def _recorded_in_run_folder(module, mode: str, line: str, use: preflight.StepUse, watch: StartWatch):
    """While upstream's ``main`` runs, check the run before it trains and make its run folder record the fix.

    Upstream's ``main`` parses its args, sets up its process group
    (``init_distributed_device``), then creates the run folder, opens ``out.log``
    (``setup_logging``) and writes ``params.txt`` from ``vars(args)``, looking
    each function up in its module at call time. Wrapping them for the run adds
    ``args.naflex_accum``, runs the self-check once the ranks can agree (on an
    upstream without that function, right after parsing), shows ``watch`` where
    the start begins and where the self-check ends, and logs the record right
    after logging is set up; an upstream without them runs unchanged (the
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
                _checked(parsed, mode, lines, use)
            return parsed
        return parse_args_recorded

    def checked(init_distributed_device):
        def init_distributed_device_checked(args, *rest, **kwargs):
            watch.enter(args)
            device = init_distributed_device(args, *rest, **kwargs)
            _checked(args, mode, lines, use)
            watch.arm()
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


def _check_patchable() -> None:
    """Refuse, in one line, an open_clip the fix cannot be installed on, before anything else is read."""
    try:
        module = import_target()
        current = getattr(module, TARGET_NAME, None)
        if not is_ours(current):
            gate(module, current)
    except PatchError as exc:
        raise UsageError(_refusal(exc)) from None


def _preflight(module, argv: Sequence[str], prog: str):
    """Upstream's parsed ARGS checked before its ``main`` starts: None after ``--help``, else the step's use.

    An upstream ``main`` module without ``parse_args`` gets ARGS unchecked (its ``--help`` included)."""
    parse_args = getattr(module, "parse_args", None)
    if not callable(parse_args):
        return preflight.StepUse(True, "upstream's arguments not read")
    args = cmdline.parse(parse_args, argv, prog)
    if args is None:
        return None
    line = preflight.refusal(args)
    if line is not None:
        # Every rank of a launch reads the same ARGS and variables: rank 0 alone says it.
        raise (UsageError if process_rank() == 0 else QuietUsageError)(line)
    return preflight.step_use(args)


def run(argv: Sequence[str], prog: str = USAGE_PROG) -> int:
    """Install the patch, then hand ``argv`` to upstream's ``main``; ``UsageError`` if it cannot start."""
    mode = resolve_mode()  # $NAFLEX_ACCUM_MODE, else the default; a bad value stops here
    enabled()  # a bad $NAFLEX_ACCUM_VERIFY too
    _check_patchable()
    module = _upstream_main_module()
    use = _preflight(module, argv, prog)
    if use is None:  # --help was printed
        return 0
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(patched(mode=mode))
        except PatchError as exc:
            raise UsageError(_refusal(exc)) from None
        watch = StartWatch()
        stack.callback(watch.close)
        stack.enter_context(_recorded_in_run_folder(module, mode, describe(mode), use, watch))
        try:
            code = _exit_code(module.main(list(argv)))
        except StepError as exc:  # the step's own one-line refusal, raised deep inside upstream's loop
            raise UsageError(f"the accumulation step stopped the run: {' '.join(str(exc).split())}") from None
        except UsageError:  # the runner's own (the self-check's), one line already
            raise
        except BaseException as exc:  # upstream's own failure: before its first step, one line and no run folder
            line = watch.failed(exc)
            if line is None:
                raise
            raise StartFailed(line) from None
        if code and watch.before_first_step():  # it refused to start (-1): what it made goes, as above
            watch.settle()
        return code


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        return run(argv)
    except QuietUsageError:  # rank 0 says it
        return 2
    except UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
