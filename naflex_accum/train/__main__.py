"""``python -m naflex_accum.train ARGS`` (and ``torchrun ... -m naflex_accum.train ARGS``): the trainer."""
import sys  # built in: loaded before any code runs

try:  # a Ctrl-C while the entry point loads is its one line too (``naflex_accum.cli`` sets it up)
    from ..cli import entry
except KeyboardInterrupt:
    print("naflex-accum train: interrupted", file=sys.stderr, flush=True)
    raise SystemExit(130) from None

if __name__ == "__main__":
    sys.exit(entry(["train", *sys.argv[1:]]))
