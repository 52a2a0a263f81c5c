"""Install the fixed accumulation step into upstream open_clip main, and take it out again.

Invariant: ``open_clip_train.train._train_step_eager`` is replaced only after the installed open_clip passes
``probe`` (or the caller forces it), by a step speaking the generation found that carries the original as
``__wrapped__``; ``uninstall()`` restores it only while the attribute is still ours; installing over ours is a
no-op for the same mode and a ``StepError`` for another. Replacing the module attribute is enough: upstream's
``train_one_epoch`` looks it up at every call. docs/upstream.md, "The patching API".
"""
import contextlib
import importlib
import inspect
import logging
import sys
import threading
import warnings
from importlib.metadata import version
from typing import Callable, Optional

from ..accum.modes import get_step, make_step, resolve_mode
from ..errors import PatchError, StepError
from ..ranks import process_rank
from .probe import probe

TARGET_MODULE = "open_clip_train.train"
TARGET_NAME = "_train_step_eager"
TARGET = f"{TARGET_MODULE}.{TARGET_NAME}"
EXPECTED_PARAMS = ("task", "batch", "accum_state", "optimizer", "scaler", "autocast", "args")
EXPECTED = f"{TARGET}({', '.join(EXPECTED_PARAMS)})"
# Set on every function this module installs, so ownership survives re-imports.
OWNER_MARK = "_naflex_accum_patch"
ANY_OPEN_CLIP = "`naflex-accum train` works with any open_clip"
MISSING = f"no attribute {TARGET_NAME!r} in {TARGET_MODULE}"  # what open_clip 3.3.0 (PyPI) has

_log = logging.getLogger(__name__)
_lock = threading.RLock()
_announced = False


CONTRACTS = "a task-and-step contract the fix knows"


def patch_error(version: str, found: str, expected: str = EXPECTED) -> PatchError:
    """The one line for an open_clip the patch cannot be installed on: what is there, what it needs."""
    return PatchError(f"open_clip_torch {version}: cannot patch {TARGET}: expected {expected} (upstream open_clip "
                      f"main, 4.x dev, with NaFlex training), found {found}. {ANY_OPEN_CLIP}; "
                      f"install(force=True) patches anyway.", version, found, expected, found == MISSING)


def open_clip_version() -> str:
    """The version of the open_clip in use, for messages; never raises. The imported package's own first: a
    source tree ahead on ``sys.path`` shadows the installed distribution's metadata."""
    if "open_clip" in sys.modules:
        try:
            from open_clip.version import __version__  # only if imported: the one on sys.path is the one used
            return __version__
        except Exception:
            pass
    try:
        return version("open_clip_torch")
    except Exception:  # not installed as a distribution
        return "(not installed)"


def contract_problem(fn) -> Optional[str]:
    """None when ``fn`` matches upstream's step signature, else what was found instead."""
    if fn is None:
        return MISSING
    if not callable(fn):
        return f"{TARGET_NAME} = a {type(fn).__name__}, not a function"
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        return f"{TARGET_NAME} with no readable signature ({exc})"
    params = list(sig.parameters.values())
    names = tuple(p.name for p in params)
    plain = all(p.kind is p.POSITIONAL_OR_KEYWORD and p.default is p.empty for p in params)
    if names != EXPECTED_PARAMS or not plain:
        return f"{TARGET}{sig}"
    return None


def import_target():
    """``open_clip_train.train``, or ``PatchError`` saying why it cannot be imported."""
    try:
        return importlib.import_module(TARGET_MODULE)
    except ImportError as exc:
        raise patch_error(open_clip_version(), f"{TARGET_MODULE} cannot be imported ({exc})") from None


def is_ours(fn) -> bool:
    return getattr(fn, OWNER_MARK, False) is True


def is_installed() -> bool:
    """Whether upstream's step is ours right now (never imports open_clip to find out)."""
    return is_ours(_current())


def _make_replacement(original, step: Callable, name: str, found, mode: str) -> Callable:
    def _train_step_eager(task, batch, accum_state, optimizer, scaler, autocast, args):
        _train_step_eager.calls += 1
        return step(task, batch, accum_state, optimizer, scaler, autocast, args)

    _train_step_eager.__doc__ = f"naflex_accum.{name}, speaking {describe_contract(step.contract)}."
    setattr(_train_step_eager, OWNER_MARK, True)
    _train_step_eager.step, _train_step_eager.probe, _train_step_eager.mode = step, found, mode
    _train_step_eager.calls = 0  # the runner tells a start that reached the step from one that did not
    if original is not None:
        _train_step_eager.__wrapped__ = original
    return _train_step_eager


def describe_contract(contract) -> str:
    return contract.describe() if contract is not None else "whichever contract each task result's form shows (forced)"


def probe_contract(module, original):
    """What contract ``original`` (upstream's step in ``module``) and upstream's tasks have here (``probe.Probe``)."""
    return probe(module, original)


def _current():
    """``open_clip_train.train._train_step_eager`` as it is now, or None (never imports open_clip to find out)."""
    module = sys.modules.get(TARGET_MODULE)
    return getattr(module, TARGET_NAME, None) if module is not None else None


def original_step():
    """Upstream's own step as installed (under ours, the one ours replaced); None when there is none."""
    current = _current()
    return getattr(current, "__wrapped__", None) if is_ours(current) else current


def installed_step():
    """The step object behind the installed replacement (``.contract`` says what it speaks), or None."""
    current = _current()
    return current.step if is_ours(current) else None


def step_calls() -> int:
    """How often the installed replacement has been called in this process (0 when none is installed)."""
    current = _current()
    return current.calls if is_ours(current) else 0


def _announce(message: str) -> None:
    """Say ``message`` once per process, on rank 0 only: to stderr wherever an INFO record would be dropped
    (logging not configured yet, or at WARNING)."""
    global _announced
    if _announced or process_rank() != 0:
        return
    _announced = True
    if _log.hasHandlers() and _log.isEnabledFor(logging.INFO):
        _log.info(message)
    else:
        print(f"naflex-accum: {message}", file=sys.stderr, flush=True)


def describe(mode: Optional[str] = None) -> str:
    """What ``install(mode=mode)`` puts in place, in one line (for logs and run records)."""
    step = installed_step()
    spoken = f"; {describe_contract(step.contract)}" if step is not None else ""
    return (f"{TARGET} replaced by naflex_accum.{get_step(mode).__name__} (accumulation mode "
            f"{resolve_mode(mode)}: one loss scale per accumulation window; open_clip_torch {open_clip_version()}"
            f"{spoken})")


def gate(module, current, contract=None):
    """The contract to install for on ``module`` whose step is ``current``, and the probe that found it;
    ``PatchError`` when none fits. ``install`` and ``naflex-accum verify`` both decide by it."""
    problem = contract_problem(current)
    if problem is not None:
        raise patch_error(open_clip_version(), problem)
    if contract is not None:
        return contract, None
    found = probe_contract(module, current)
    if found.problem is not None:
        raise patch_error(open_clip_version(), found.problem, CONTRACTS)
    return found.contract, found


def _check(module, current, force: bool, contract):
    """``gate``'s answer; with ``force``, a warning instead of its error (the step then follows each task)."""
    try:
        return gate(module, current, contract)
    except PatchError as error:
        if not force:
            raise
        warnings.warn(f"{error} Installing anyway because force=True.", RuntimeWarning, stacklevel=3)
        return contract, None


def _refuse_another(current, mode: Optional[str], contract) -> None:
    """``StepError`` when ``install`` asks for another step than ``current`` (ours): refused, not switched (a running
    loop may be mid-window, and ``patched()`` could not put the earlier step back)."""
    wanted, installed = resolve_mode(mode), getattr(current, "mode", None)
    asked = f"mode={mode!r}" if mode else f"mode=None, that is {wanted} ($NAFLEX_ACCUM_MODE, else the default)"
    if wanted != installed:
        raise StepError(f"install({asked}): the {installed} step is already installed; uninstall() first to "
                        f"switch modes (installing the same mode again is a no-op).")
    if contract is not None and contract is not current.step.contract:
        raise StepError(f"install(contract=...) asks for {contract.describe()}, but the installed step speaks "
                        f"{describe_contract(current.step.contract)}; uninstall() first to switch contracts.")


def install(force: bool = False, mode: Optional[str] = None, contract=None) -> Callable:
    """Replace upstream's ``_train_step_eager`` with the fixed step, returned: a no-op over ours in the same mode,
    ``StepError`` over another, ``PatchError`` where no contract fits unless ``force``. docs/upstream.md,
    "The patching API"."""
    name = get_step(mode).__name__  # an unknown mode fails before anything is touched
    with _lock:
        module = import_target()
        current = getattr(module, TARGET_NAME, None)
        if is_ours(current):
            _refuse_another(current, mode, contract)
            return current
        contract, found = _check(module, current, force, contract)
        replacement = _make_replacement(current, make_step(mode, contract), name, found, resolve_mode(mode))
        setattr(module, TARGET_NAME, replacement)
        _announce(f"{describe(mode)}.")
        return replacement


def uninstall() -> bool:
    """Put upstream's original step back if ours is installed; True when something was restored."""
    with _lock:
        module = sys.modules.get(TARGET_MODULE)
        current = getattr(module, TARGET_NAME, None) if module is not None else None
        if not is_ours(current):
            return False
        original = getattr(current, "__wrapped__", None)
        if original is None:  # forced onto an open_clip that had no such attribute
            delattr(module, TARGET_NAME)
        else:
            setattr(module, TARGET_NAME, original)
        _log.debug("%s restored to upstream's original", TARGET)
        return True


@contextlib.contextmanager
def patched(force: bool = False, mode: Optional[str] = None, contract=None):
    """``with patched(): ...``: the block with the fixed step installed, then only what it installed removed."""
    was_installed = is_installed()
    fn = install(force=force, mode=mode, contract=contract)
    try:
        yield fn
    finally:
        if not was_installed:
            uninstall()
