"""``python -m naflex_accum.openclip ARGS`` (and ``torchrun ... -m naflex_accum.openclip ARGS``): upstream open_clip
main's trainer with the fixed step installed. The runner itself is ``naflex_accum.upstream.runner``."""
import sys

from .upstream.runner import main

if __name__ == "__main__":
    sys.exit(main())
