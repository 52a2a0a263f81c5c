"""``python -m naflex_accum.openclip ARGS`` in a process whose logging runs at WARNING.

A launcher that configured logging at WARNING before the runner starts, and
upstream's own ``setup_logging`` held at WARNING: no INFO record reaches a
handler, so any line in the run folder got there by other means.
"""
import logging
import sys

logging.basicConfig(level=logging.WARNING)

import open_clip_train.main as upstream_main  # noqa: E402

_setup_logging = upstream_main.setup_logging


def setup_logging_at_warning(log_file, level, *args, **kwargs):
    return _setup_logging(log_file, logging.WARNING, *args, **kwargs)


upstream_main.setup_logging = setup_logging_at_warning

from naflex_accum.openclip import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
