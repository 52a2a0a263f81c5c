"""``naflex-accum train``: see ``naflex_accum.train.main``.

Torch's C++ logger, read once as torch loads, prints a warning with a C++ stack for each store call that
meets a peer's closed connection (rank 0 gone under srun), where every rank already says in one line what
happened: its level is ERROR here unless ``TORCH_CPP_LOG_LEVEL`` says otherwise.
"""
import os

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
from ..train.main import main as train_main  # noqa: E402 (after the line above: torch reads it as it loads)


def main(argv, prog="naflex-accum train", ends_process=False) -> int:
    return train_main(argv, prog, ends_process)
