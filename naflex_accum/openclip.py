"""``python -m naflex_accum.openclip ARGS`` (and ``torchrun ... -m naflex_accum.openclip ARGS``): upstream open_clip
main's trainer with the fixed step installed. The runner itself is ``naflex_accum.upstream.runner``, imported
on the first call (it imports torch and open_clip): a Ctrl-C at any moment, that import included, is one
``naflex_accum.openclip: interrupted`` line and exit 130 (``interrupt``), set up by the first statement of
``python -m`` (importing this module changes nothing)."""
try:  # first: a Ctrl-C from here on is the one line
    from .interrupt import finished, install, interrupted, loading, quiet_fd_sharing_errors

    if __name__ == "__main__":
        install()
    import sys

    from . import output
except KeyboardInterrupt:
    import sys  # built in: loaded before any code runs

    print("naflex_accum.openclip: interrupted", file=sys.stderr, flush=True)
    exec("pass")  # as interrupt.interrupted does, which may not be imported yet
    raise SystemExit(130) from None

PROG = __spec__.name  # this module's name under python -m too (the runner's PROG, imported only on the first call)


def main(argv=None) -> int:
    """Upstream's main with the fixed step, on ``argv`` (a list of strings; default ``sys.argv[1:]``)."""
    from .upstream.runner import main as run  # here, not at the top: see the module's docstring
    quiet_fd_sharing_errors()
    return run(argv)


def entry() -> int:
    install()
    try:
        output.install()  # | head: the run goes on to its own end and status (``output``)
        with loading(PROG):  # the runner's imports: a Ctrl-C in them ends the process at once (``interrupt``)
            from .upstream import runner  # noqa: F401
        code = main()
        finished()  # from here on a Ctrl-C changes nothing
        return code
    except KeyboardInterrupt:
        return interrupted(PROG)
    finally:
        finished()
        output.flush()


if __name__ == "__main__":
    try:  # a Ctrl-C as entry() starts, before its own try
        sys.exit(entry())
    except KeyboardInterrupt:
        sys.exit(interrupted(PROG))
