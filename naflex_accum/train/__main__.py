"""``python -m naflex_accum.train ARGS`` (and ``torchrun ... -m naflex_accum.train ARGS``): the trainer."""
import sys

from ..cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
