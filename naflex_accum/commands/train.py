"""``naflex-accum train``: see ``naflex_accum.train.main``. Torch's C++ logger (its level read as torch loads) would
print a C++ stack per store call meeting a peer's closed connection, which each rank's one line already tells:
ERROR unless ``TORCH_CPP_LOG_LEVEL`` says otherwise."""
import os

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
from ..train.main import main as train_main  # noqa: E402 (after the line above: torch reads it as it loads)


def main(argv, prog="naflex-accum train", ends_process=False) -> int:
    return train_main(argv, prog, ends_process)
