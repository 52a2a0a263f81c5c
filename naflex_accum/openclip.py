"""Run upstream open_clip main's trainer with the fixed accumulation step installed.

    python -m naflex_accum.openclip ARGS...
    torchrun --nproc-per-node 8 -m naflex_accum.openclip ARGS...
    naflex-accum openclip ARGS...

Invariant: ARGS reach ``open_clip_train.main.main`` unchanged, and only once
the patch is in place in this process (every torchrun rank installs its own);
an open_clip that lacks the step being replaced (3.3.0 from PyPI has no NaFlex
training) stops here with exit 2 and one line, before any work starts.
"""
import contextlib
import importlib
import sys
from typing import List, Optional, Sequence

from .errors import UsageError

PROG = "naflex_accum.openclip"
UPSTREAM_MAIN = "open_clip_train.main"


def _refusal(exc) -> str:
    """One line for a PatchError: what is installed, what is missing, and the way out."""
    if exc.missing:
        return (f"open_clip_torch {exc.version} has no NaFlex training step to patch ({exc.expected} is "
                f"missing; it is in upstream open_clip main, 4.x dev): use `naflex-accum train`, which works "
                f"with any open_clip, or install open_clip from its git checkout.")
    return (f"open_clip_torch {exc.version} cannot take the fix: expected {exc.expected}, found {exc.found}. "
            f"This runner needs upstream open_clip main with NaFlex training (pip install it from its git "
            f"checkout); `naflex-accum train` works with any open_clip.")


def _exit_code(result) -> int:
    # Upstream's main returns None after training and -1 when it refuses to
    # start (an experiment name already in use, say); its own __main__ drops
    # that value, the runner turns it into a failing exit status.
    return 0 if result is None or result == 0 else 1


def _upstream_main():
    try:
        return importlib.import_module(UPSTREAM_MAIN).main
    except ImportError as exc:
        raise UsageError(
            f"cannot import {UPSTREAM_MAIN} ({exc}); install open_clip with its training extras "
            f"(pip install '.[training]' in its git checkout).") from None


def run(argv: Sequence[str]) -> int:
    """Install the patch, then hand ``argv`` to upstream's ``main``; ``UsageError`` if it cannot start."""
    from .patch import PatchError, patched

    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(patched())
        except PatchError as exc:
            raise UsageError(_refusal(exc)) from None
        return _exit_code(_upstream_main()(list(argv)))


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        return run(argv)
    except UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
