"""``naflex-accum openclip ARGS...``: upstream open_clip main's trainer with the fixed step installed.

Invariant: the same as ``python -m naflex_accum.openclip`` (``upstream.runner``).
"""
from ..errors import QuietUsageError
from ..upstream.runner import run


def main(argv, prog="naflex-accum openclip", ends_process=False) -> int:
    # No parser of our own: every ARG, --help included, belongs to upstream's.
    try:
        return run(argv, prog)
    except QuietUsageError:  # rank 0 says it
        return 2
