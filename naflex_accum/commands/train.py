"""``naflex-accum train``: see ``naflex_accum.train.main``."""


def main(argv, prog="naflex-accum train") -> int:
    from ..train.main import main as train_main
    return train_main(argv, prog)
