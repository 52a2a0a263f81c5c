"""``naflex-accum openclip ARGS...``: upstream open_clip main's trainer with the fixed step installed.

Invariant: the same as ``python -m naflex_accum.openclip``: ARGS go to
``open_clip_train.main.main`` unchanged, after the patch is in place; an
open_clip without NaFlex training, or ARGS upstream would crash on, exit 2
with one line (on rank 0 only, when every rank refuses the same ARGS); a start
that fails before its first step, exit 1 with one line and no run folder it made.
"""
from ..errors import QuietUsageError
from ..upstream.runner import run


def main(argv, prog="naflex-accum openclip", ends_process=False) -> int:
    # No parser of our own: every ARG, --help included, belongs to upstream's.
    try:
        return run(argv, prog)
    except QuietUsageError:  # rank 0 says it
        return 2
