"""``python -m naflex_accum.openclip ARGS`` (and ``torchrun ... -m naflex_accum.openclip ARGS``): upstream open_clip
main's trainer with the fixed step installed. The runner itself is ``naflex_accum.upstream.runner``, imported
on the first call (it imports torch and open_clip): a Ctrl-C at any moment, that import included, is one
``naflex_accum.openclip: interrupted`` line and exit 130 (``interrupt``)."""
import sys
from typing import List, Optional

from .interrupt import finished, install, interrupted

PROG = "naflex_accum.openclip"  # the name the runner's one-line messages begin with


def main(argv: Optional[List[str]] = None) -> int:
    from .upstream.runner import main as run  # here, not at the top: see the module's docstring
    return run(argv)


def entry() -> int:
    install()
    try:
        code = main()
        finished()  # from here on a Ctrl-C changes nothing
        return code
    except KeyboardInterrupt:
        return interrupted(PROG)
    finally:
        finished()


if __name__ == "__main__":
    sys.exit(entry())
