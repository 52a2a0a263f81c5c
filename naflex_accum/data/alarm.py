"""The wait for a batch of a loader that reads in this process (``--workers 0``), bounded by ``--data-timeout``.

Invariant: while the main thread waits for such a batch, an interval timer runs;
once the wait passes ``timeout`` seconds its SIGALRM handler kills the process
groups of the ``pipe:`` commands this process has open (``pipes.kill_all``) and
raises inside the read. A read blocked on a command, a FIFO or a socket returns
to Python for the handler (PEP 475), and what it raises is a ``BaseException``,
so no ``except Exception`` of the pipeline takes it for a bad sample; every
stream is closed on its way out, and the wait raises ``LoaderTimeout`` (a
``TransientError``: exit 74) within moments of the timeout. The timer is stopped
and the previous SIGALRM handler put back when the wait ends. Only the main
thread takes signals: elsewhere, with no timeout, or while another real-time
timer is armed (pytest-timeout's, say: there is one such timer a process, and it
is left as it is), the wait is not bounded; a read stuck inside the kernel (a
hard NFS mount) is out of any signal's reach.
Loader workers are watched by ``workers``' watchdog instead.
"""
import contextlib
import signal
import threading

from ..errors import TransientError
from .pipes import kill_all


class LoaderTimeout(TransientError):
    """No batch came from the in-process loader within ``--data-timeout`` seconds."""


class _Expired(BaseException):
    """Raised by the handler inside the pipeline's read: no ``Exception``, so no sample's error handling takes it."""


@contextlib.contextmanager
def bounded(timeout: float, what: str = "no batch came from the loader (reading in this process) for"):
    """``with bounded(timeout): next(source)``: raises ``LoaderTimeout`` once the block has run ``timeout`` seconds
    ("{what} {timeout} s (--data-timeout)")."""
    if timeout <= 0 or threading.current_thread() is not threading.main_thread() \
            or signal.getitimer(signal.ITIMER_REAL)[0] > 0:
        yield
        return
    state = {"armed": True, "killed": []}

    def expire(signum, frame):
        if state["armed"]:  # a signal handled after the wait ended (a moment late) is ignored
            state["armed"] = False
            state["killed"] = kill_all()
            raise _Expired()
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        try:
            yield
        finally:
            state["armed"] = False
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, signal.SIG_DFL if previous is None else previous)
    except _Expired:
        pids = state["killed"]
        killed = f": killed its pipe: command(s) (process groups {', '.join(map(str, pids))})" if pids else ""
        raise LoaderTimeout(f"{what} {timeout:g} s (--data-timeout){killed}") from None
