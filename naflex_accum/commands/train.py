"""``naflex-accum train``: see ``naflex_accum.train.main``. In a process of its own, a bug goes to torchelastic's
error file (``record``), so torchrun's summary shows it, traceback and all, as the rank's root cause. Torch's C++
logger (its level read as torch loads) would print a C++ stack per store call meeting a peer's closed connection,
which each rank's one line already tells: ERROR unless ``TORCH_CPP_LOG_LEVEL`` says otherwise."""
import os

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402 (as below)

from ..train.main import main as train_main  # noqa: E402 (after the line above: torch reads it as it loads)


def main(argv, prog="naflex-accum train", ends_process=False) -> int:
    # record also turns faulthandler on (stacks on SIGABRT), which only a process of its own should
    return (record(train_main) if ends_process else train_main)(argv, prog, ends_process)
