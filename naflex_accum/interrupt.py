"""Ctrl-C: one line ``PROG: interrupted`` on stderr and exit 130, whatever the command was doing.

Invariant: from ``install`` on, SIGINT raises ``KeyboardInterrupt`` in the installing process alone (forked
children ignore it: their parent stops them), once; a ``deferred`` block holds it to the block's end, a
``loading`` block ends the process at once, and after ``finished`` it is ignored. Nothing here imports what
Python's start-up has not loaded. docs/long-runs.md, "Ctrl-C: one line, exit 130".
"""
import os
import sys

# ``signal``'s own C module, loaded by Python's start-up; ``signal`` itself is not, and importing it before
# the handler is in place would leave a Ctrl-C during that import a traceback
import _signal

SIGINT = _signal.SIGINT
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a command that Ctrl-C ended


def install() -> None:
    """SIGINT raises ``KeyboardInterrupt`` in this process only. Only Python's own handler is replaced: an ignored
    SIGINT stays ignored, a program's own handler stays, and outside the main thread nothing changes."""
    if _signal.getsignal(SIGINT) is not _signal.default_int_handler:
        return
    owner = os.getpid()

    def on_sigint(signum, frame):
        if os.getpid() != owner:
            return  # a forked child (a loader worker): its parent stops it
        _signal.signal(SIGINT, _signal.SIG_IGN)  # a second Ctrl-C must not cut the stop short
        threading = sys.modules.get("threading")
        if threading is not None:  # a thread failing while the stop unwinds (a DataLoader's fd-sharing server
            threading.excepthook = lambda args: None  # whose worker is gone) is its consequence: no traceback
        raise KeyboardInterrupt

    try:
        _signal.signal(SIGINT, on_sigint)
    except ValueError:  # not the main thread
        pass


def quiet_fd_sharing_errors() -> None:
    """A connection error in ``multiprocessing.resource_sharer``'s thread (a worker ended mid-handshake) prints
    nothing, whether the thread hands it to ``sys.excepthook`` or it reaches ``threading.excepthook``."""
    import threading  # here, not at the top: install() must load nothing Python's start-up has not (see above)

    def serving(kind, thread) -> bool:
        return issubclass(kind, (ConnectionError, EOFError)) and getattr(thread, "name", "").endswith("(_serve)")

    previous, previous_sys = threading.excepthook, sys.excepthook
    if not getattr(previous, "quiets_fd_sharing", False):
        def hook(args):
            if not serving(args.exc_type, args.thread):
                previous(args)

        def sys_hook(kind, value, traceback):
            if not serving(kind, threading.current_thread()):
                previous_sys(kind, value, traceback)
        hook.quiets_fd_sharing, threading.excepthook, sys.excepthook = True, hook, sys_hook


class _Block:
    """SIGINT goes to ``on_sigint`` until the block ends, then to the handler before it, and ``after(kind)`` runs
    (main thread only; a handler set outside Python, which cannot be put back, is left as it is)."""

    def __init__(self, on_sigint, after=lambda kind: None):
        self.on_sigint, self.after, self.previous = on_sigint, after, None

    def __enter__(self):
        previous = _signal.getsignal(SIGINT)
        if previous is not None:
            try:
                _signal.signal(SIGINT, self.on_sigint)
                self.previous = previous
            except ValueError:  # not the main thread: a thread cannot set a handler
                pass
        return self

    def __exit__(self, kind, value, traceback):
        if self.previous is not None:
            _signal.signal(SIGINT, self.previous)
            self.after(kind)
        return False


def loading(prog: str, last=lambda code: None) -> _Block:
    """A block that loads a command's modules, in a process of its own: a Ctrl-C in it ends the process at once
    (its line, ``last(130)``, exit 130). Raised there, a ``KeyboardInterrupt`` can land in a C extension's
    initialisation (numpy's, torch's), which leaves it half loaded (a later import fails), swallowed (the command
    runs on) or, under a C++ callback, an abort; nothing is made before the command runs, so nothing is lost."""
    def now(signum, frame):
        code = interrupted(prog)
        last(code)
        os._exit(code)
    current = _signal.getsignal(SIGINT)
    return _Block(current if current in (_signal.SIG_IGN, _signal.SIG_DFL) else now)  # an ignored one stays so


def deferred() -> _Block:
    """A block that holds a SIGINT until it ends (starting the loader's workers: one inside fork's hooks would be
    dropped or leave workers unrecorded). Main thread only."""
    held, owner = [], os.getpid()

    def hold(signum, frame):
        if os.getpid() == owner:
            held.append(signum)

    def after(kind):
        if held and kind is None:
            _signal.raise_signal(SIGINT)
    return _Block(hold, after)


def finished() -> None:
    _signal.signal(SIGINT, _signal.SIG_IGN)


def interrupted(prog: str) -> int:
    """Say ``PROG: interrupted`` and return the exit status for it (handled: the process exits with it)."""
    print(f"{prog}: interrupted", file=sys.stderr, flush=True)
    # A KeyboardInterrupt that left an exec() of a string (dataclasses and namedtuple make their methods so
    # while a module imports) marks CPython to end a ``python -m`` process by SIGINT, whatever status it
    # exits with; running a string through exec() clears that mark (CPython 3.8 to 3.13 alike).
    exec("pass")
    return EXIT_INTERRUPTED
