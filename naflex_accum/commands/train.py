"""``naflex-accum train``: see ``naflex_accum.train.main``."""
from ..train.main import main as train_main


def main(argv, prog="naflex-accum train", ends_process=False) -> int:
    return train_main(argv, prog, ends_process)
