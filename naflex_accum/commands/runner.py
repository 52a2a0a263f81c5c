"""``naflex-accum openclip ARGS...``: upstream open_clip main's trainer with the fixed step installed.

Invariant: the same as ``python -m naflex_accum.openclip``: ARGS go to
``open_clip_train.main.main`` unchanged, after the patch is in place; an
open_clip without NaFlex training exits 2 with one line.
"""
from ..upstream.runner import run


def main(argv, prog="naflex-accum openclip", ends_process=False) -> int:
    # No argparse here: every ARG, --help included, belongs to upstream.
    return run(argv)
