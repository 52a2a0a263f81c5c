"""Ctrl-C: one line ``PROG: interrupted`` on stderr and exit 130, whatever the command was doing.

Invariant: a terminal sends SIGINT to every process of its foreground group: the command's process and the
processes it forked (the data loader's workers). From ``install`` on (each entry point calls it before its
heavy imports), SIGINT raises ``KeyboardInterrupt`` in the process that installed it alone, and the entry
point turns it into the one line (``interrupted``) once the teardown it unwinds through has run (workers
stopped, the run folder's lock released; a checkpoint being written is not there, the one before it
whole: ``train.checkpoint``); a forked child inherits the handler and ignores SIGINT, since its parent stops it.
Only the first SIGINT counts: more, while the command stops (a Ctrl-C pressed twice), are ignored.
A SIGINT inside a ``deferred`` block (starting the loader's workers) acts when the block ends. Once the
command has returned, ``finished`` ignores SIGINT, so a late Ctrl-C cannot change its status. Nothing here
imports more than the standard library.
"""
import contextlib
import os
import signal
import sys
import threading

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a command that Ctrl-C ended


def install() -> None:
    """SIGINT raises ``KeyboardInterrupt`` in this process only (call from the main thread); a process started
    with SIGINT ignored (a shell script's background command) keeps ignoring it."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        return
    owner = os.getpid()

    def on_sigint(signum, frame):
        if os.getpid() != owner:
            return  # a forked child (a loader worker): its parent stops it
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the stop short
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)


@contextlib.contextmanager
def deferred():
    """Hold a SIGINT that arrives inside the block until the block ends, then let the handler before act on it.

    For a block that must not be left half done: starting the loader's workers, where a KeyboardInterrupt
    raised inside fork's hooks would be dropped, and one raised before the workers are recorded
    (``data.workers``) would leave them running. Processes forked inside ignore it. Main thread only.
    """
    previous = signal.getsignal(signal.SIGINT)
    if previous is None or threading.current_thread() is not threading.main_thread():
        yield  # a handler set outside Python cannot be put back; a thread cannot set one
        return
    owner, held = os.getpid(), []

    def hold(signum, frame):
        if os.getpid() == owner:
            held.append(signum)
    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if held:
        signal.raise_signal(signal.SIGINT)


def finished() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def interrupted(prog: str) -> int:
    """Say ``PROG: interrupted`` and return the exit status for it (handled: the process exits with it)."""
    print(f"{prog}: interrupted", file=sys.stderr, flush=True)
    # A KeyboardInterrupt that left an exec() of a string (dataclasses and namedtuple make their methods so
    # while a module imports) marks CPython to end a ``python -m`` process by SIGINT, whatever status it
    # exits with; running a string through exec() clears that mark (CPython 3.8 to 3.13 alike).
    exec("pass")
    return EXIT_INTERRUPTED
