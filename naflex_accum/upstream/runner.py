"""Run upstream open_clip main's trainer with the fixed accumulation step installed.

    python -m naflex_accum.openclip ARGS...      (torchrun -m ..., naflex-accum openclip ...)

Invariant: ARGS reach ``open_clip_train.main.main`` unchanged, once the patch is in place in this process; an
upstream the fix cannot patch, or ARGS it would crash on or mistrain (``preflight``), stop here with exit 2 and
one line, nothing created. Every rank audits the step before the run folder exists (``selfcheck``); the run
folder records the fix, mode, upstream and verdict; a start that fails before its first step is one line, exit
1, taking back only what it made (``startup``). docs/upstream.md, "The runner".
"""
import contextlib
import importlib
import logging
import sys
from typing import List, Optional, Sequence

from ..accum.modes import resolve_mode
from ..errors import PatchError, QuietUsageError, StartFailed, StepError, UsageError
from ..ranks import WORLD_VARS, launched_int, process_rank
from ..version import __version__
from . import cmdline, preflight
from .patch import TARGET_NAME, describe, gate, import_target, is_ours, patched
from .selfcheck import check_run, enabled, record_unused
from .startup import StartWatch

PROG = "naflex_accum.openclip"  # python -m PROG runs main(); the name its one-line messages begin with
USAGE_PROG = f"python -m {PROG}"  # the name --help shows
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
    """Hand one INFO record to every root handler but the console (upstream's out.log), whatever the levels:
    a run's provenance must not depend on them (the console had each line on stderr already)."""

    if process_rank() != 0:
        return
    record = _log.makeRecord(_log.name, logging.INFO, __file__, 0, message, None, None)
    for handler in logging.getLogger().handlers:
        if not _is_console(handler):
            handler.handle(record)


def _checked(args, mode: str, lines: list, use: preflight.StepUse) -> None:
    """The self-check of this run (every rank), its lines kept for out.log and said on stderr by rank 0; a run whose
    loop never calls the step is not audited (its record says why)."""
    lines.extend(check_run(args, mode) if use.used else record_unused(args, use.why))
    if process_rank() == 0:
        print("\n".join(f"naflex-accum: {text}" for text in lines[1:]), file=sys.stderr, flush=True)


@contextlib.contextmanager
def _recorded_in_run_folder(module, mode: str, line: str, use: preflight.StepUse, watch: StartWatch):
    """While upstream's ``main`` runs, check the run before it trains and make its run folder record the fix:
    wraps ``parse_args``, ``init_distributed_device`` (the self-check) and ``setup_logging``, each put back after."""
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
    for name, wrap in (("parse_args", recorded_args), ("init_distributed_device", checked), ("setup_logging", logged)):
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
    """Upstream's parsed ARGS checked before its ``main`` starts: None after ``--help``, else the step's use (a
    ``main`` module without ``parse_args``: unchecked)."""
    parse_args = getattr(module, "parse_args", None)
    if not callable(parse_args):
        return preflight.StepUse(True, "upstream's arguments not read")
    try:
        args = cmdline.parse(parse_args, argv, prog)
        found = None if args is None else preflight.refusal(args)
    except UsageError as exc:  # argparse's refusal, or upstream's own check after parsing: the flags' alone
        args, found = None, (str(exc), False)
    if found is not None:
        raise _refused(*found)
    return None if args is None else preflight.step_use(args)


def _refused(line: str, own_node: bool) -> UsageError:
    """Every rank of a launch reads the same flags and variables: rank 0 alone says a refusal of those; one that
    read this node's files, every rank that meets it, naming itself. One process (a stray ``RANK``) says it."""
    rank = process_rank()
    if rank == 0 or launched_int(WORLD_VARS, 1) < 2:
        return UsageError(line)
    return UsageError(f"rank {rank}: {line}") if own_node else QuietUsageError(line)


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
