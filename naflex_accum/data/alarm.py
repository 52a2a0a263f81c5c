"""The wait for a batch of a loader that reads in this process (``--workers 0``), bounded by ``--data-timeout``.

Invariant: past ``timeout`` seconds a SIGALRM kills this process's ``pipe:`` groups and raises a
``BaseException`` inside the read (no ``except Exception`` takes it for a bad sample); the wait then raises
``LoaderTimeout`` (exit 74) and the previous handler is put back. Main thread only, and not while another
real-time timer is armed. docs/long-runs.md, "Loader failures: exit 74 within seconds".
"""
import signal
import threading

from ..errors import TransientError
from .pipes import kill_all


class LoaderTimeout(TransientError):
    """No batch came from the in-process loader within ``--data-timeout`` seconds."""


class _Expired(BaseException):
    """Raised by the handler inside the pipeline's read: no ``Exception``, so no sample's error handling takes it."""


class bounded:
    """``with bounded(timeout): next(source)``: raises ``LoaderTimeout`` once the block has run ``timeout`` seconds
    ("{what} {timeout} s (--data-timeout)")."""

    def __init__(self, timeout: float, what: str = "no batch came from the loader (reading in this process) for"):
        self.timeout, self.what = timeout, what
        self.armed, self.installed, self.killed, self.previous = False, False, [], None

    def __enter__(self) -> "bounded":
        if self.timeout <= 0 or threading.current_thread() is not threading.main_thread() \
                or signal.getitimer(signal.ITIMER_REAL)[0] > 0:
            return self
        self.armed = self.installed = True
        self.previous = signal.signal(signal.SIGALRM, self._expire)
        signal.setitimer(signal.ITIMER_REAL, self.timeout)
        return self

    def _expire(self, signum, frame) -> None:
        # Anywhere in the block, raise (``__exit__`` turns it into ``LoaderTimeout``); once ``__exit__`` runs, the
        # block is over and the batch came: a signal handled there, or after, is dropped. Still in ``__enter__``
        # (a timeout of a few microseconds), the block has not begun: the timer goes again, to fire inside it.
        code = frame.f_code if frame is not None else None
        if code is _ENTER_CODE and self.armed:
            signal.setitimer(signal.ITIMER_REAL, 0.001)
        elif self.armed and code is not _EXIT_CODE:
            self.armed = False
            self.killed = kill_all()
            raise _Expired()

    def __exit__(self, kind, exc, traceback) -> bool:
        if self.installed:
            self.armed = self.installed = False
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, signal.SIG_DFL if self.previous is None else self.previous)
        if kind is not None and issubclass(kind, _Expired):
            pids = self.killed
            killed = f": killed its pipe: command(s) (process groups {', '.join(map(str, pids))})" if pids else ""
            raise LoaderTimeout(f"{self.what} {self.timeout:g} s (--data-timeout){killed}") from None
        return False


_ENTER_CODE, _EXIT_CODE = bounded.__enter__.__code__, bounded.__exit__.__code__
