"""``python -m naflex_accum.train ARGS`` (and ``torchrun ... -m naflex_accum.train ARGS``): the trainer."""
import sys  # built in: loaded before any code runs

try:  # a Ctrl-C while the entry point loads, or as entry() starts, is its one line too (``naflex_accum.cli``)
    from ..cli import entry

    if __name__ == "__main__":
        sys.exit(entry(["train", *sys.argv[1:]]))
except KeyboardInterrupt:
    print("naflex-accum train: interrupted", file=sys.stderr, flush=True)
    raise SystemExit(130) from None
