"""``python -m naflex_accum.train ARGS`` (and ``torchrun ... -m naflex_accum.train ARGS``): the trainer."""
import sys

from ..cli import entry

if __name__ == "__main__":
    sys.exit(entry(["train", *sys.argv[1:]]))
