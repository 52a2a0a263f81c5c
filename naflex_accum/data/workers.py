"""Loader worker processes: registered when started, named when they fail, and never outliving the run.

Invariant: every worker is recorded as torch makes it (``context()``); a dead worker's error is raised at once
while the main thread waits for a batch, else at the next batch or the end of a ``held()`` block (a checkpoint
write); a watchdog kills workers stalled past ``timeout``; ``failure(exc)`` names any of these in one line, and
``stop_all()`` leaves no worker alive (they ignore SIGTERM). docs/long-runs.md, "Loader failures".
"""
import atexit
import contextlib
import multiprocessing
import os
import re
import signal
import threading
import time
import weakref
from typing import List, Optional

_LIVE = weakref.WeakKeyDictionary()  # DataLoader iterators whose worker processes may be alive: their processes
# Their processes, held strongly: an iterator collected without its workers stopped must not hide them.
_PROCESSES: list = []
_PENDING = []  # worker failures the SIGCHLD handler reported outside a batch wait or inside held(), not raised yet
_HELD = [0]  # how deep inside held() the main thread is
_WAITING = [0]  # how many loaders the main thread is waiting on for a batch (only there may the handler raise)


def context() -> multiprocessing.context.BaseContext:
    """The default multiprocessing context, recording in ``.processes`` each process started through it."""
    base = multiprocessing.get_context()

    class Recording(type(base)):
        def Process(self, *args, **kwargs):  # how a DataLoader iterator makes each of its workers
            process = base.Process(*args, **kwargs)
            # the parent-death signal fires when the thread that forked ends: only the main thread's workers take it,
            # and not a forkserver's (their parent is the server)
            process.dies_with_parent = (threading.current_thread() is threading.main_thread()
                                        and base.get_start_method() != "forkserver")
            self.processes.append(process)
            return process
    recording = Recording()
    recording.processes = []
    return recording


def of(loader) -> List[multiprocessing.Process]:
    """The worker processes of ``loader``'s current iterator, once ``iter(loader)`` started them: the newest
    ``num_workers`` that its ``context()`` made ([] for a dataset, or a loader that reads in this process)."""
    started = getattr(getattr(loader, "multiprocessing_context", None), "processes", None)
    return started[-loader.num_workers:] if started else []


class Watch:
    """One iterator's wait for its next batch: ``with watch.waiting(): next(it)``."""

    def __init__(self, processes=(), timeout: float = 0.0):
        self.processes, self.timeout = list(processes), timeout
        self.since: Optional[float] = None
        self.expired: Optional[str] = None  # what the watchdog did, once it did

    @contextlib.contextmanager
    def waiting(self):
        self.since = time.monotonic()
        _WAITING[0] += 1
        try:
            yield
        finally:
            _WAITING[0] -= 1
            self.since = None


_WATCHES = weakref.WeakSet()
_WATCHDOG: Optional[threading.Thread] = None


def _watchdog() -> None:
    while True:
        time.sleep(0.25)
        for watch in list(_WATCHES):
            since = watch.since
            if since is None or watch.expired or time.monotonic() - since < watch.timeout:
                continue
            pids = [w.pid for w in watch.processes if w.is_alive()]
            watch.expired = (f"the loader workers sent no batch for {watch.timeout:g} s (--data-timeout): stopped "
                             f"them (pids {', '.join(map(str, pids)) or 'none alive'})")
            _kill(watch.processes)


def register(iterator, processes, timeout: float = 0.0) -> Watch:
    """Register a DataLoader iterator and its worker ``processes`` (``of``); its ``Watch``, armed if ``timeout``."""
    global _WATCHDOG
    if not processes:
        return Watch()
    if not _PROCESSES:
        # Runs before multiprocessing's own exit handler (registered earlier), which would wait on them.
        atexit.register(stop_all)
    _PROCESSES[:] = [p for p in _PROCESSES if p.is_alive()] + [w for w in processes if w not in _PROCESSES]
    _LIVE[iterator] = list(processes)
    _defer_sigchld()
    watch = Watch(processes, timeout)
    if timeout > 0:
        _WATCHES.add(watch)
        if _WATCHDOG is None:
            _WATCHDOG = threading.Thread(target=_watchdog, name="naflex-accum-loader-watchdog", daemon=True)
            _WATCHDOG.start()
    return watch


def _defer_sigchld() -> None:
    """Wrap the SIGCHLD handler torch set for its workers so that it raises only in a batch wait, else records."""
    current = signal.getsignal(signal.SIGCHLD)
    if getattr(current, "_naflex_accum_defers", False) or not callable(current):
        return

    def deferring(signum, frame):
        try:
            current(signum, frame)
        except RuntimeError as exc:  # torch's "DataLoader worker (pid N) is killed by signal: ..."
            if _WAITING[0] and not _HELD[0]:
                raise
            _PENDING.append(exc)
    deferring._naflex_accum_defers = True
    try:
        signal.signal(signal.SIGCHLD, deferring)
    except ValueError:  # not the main thread: torch's handler stays as it is
        pass


LOST = (ConnectionError, EOFError)  # what a read from a worker raises when the worker dies in the middle of it
PIN_THREAD_DIED = "Pin memory thread exited unexpectedly"  # torch's error once such a read ended its pin thread
LOST_GRACE = 5.0  # seconds a worker has to be seen dead after such a read failed (its reaping takes milliseconds)


def read_failed(exc: BaseException) -> bool:
    """Whether ``exc``, raised by the loader's next batch, is a read of a worker's batch that failed."""
    return isinstance(exc, LOST) or (isinstance(exc, RuntimeError) and PIN_THREAD_DIED in str(exc))


def lost(processes) -> Optional[RuntimeError]:
    """torch's error for a worker of ``processes`` seen dead within ``LOST_GRACE`` s after a read failed (a killed
    worker's sockets close before it can be reaped, so the read's error names no worker)."""
    deadline = time.monotonic() + LOST_GRACE
    while processes:
        dead = [w for w in processes if w.exitcode not in (None, 0)]
        if dead:
            return RuntimeError(f"DataLoader worker (pid(s) {', '.join(str(w.pid) for w in dead)}) exited "
                                f"unexpectedly")  # torch's wording, which ``failure`` names
        if time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    return None


def raise_pending() -> None:
    """Raise a worker failure the SIGCHLD handler recorded (at a point where the loader may fail)."""
    if _PENDING and not _HELD[0]:
        raise _PENDING.pop(0)


@contextlib.contextmanager
def held():
    """A block that a loader worker's failure must not interrupt: it is raised when the block ends."""
    _HELD[0] += 1
    try:
        yield
    finally:
        _HELD[0] -= 1
    raise_pending()


def _workers():
    return [(i, len(group), w) for group in list(_LIVE.values()) for i, w in enumerate(group)]


def _ended(index: int, count: int, worker) -> str:
    code = worker.exitcode
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        how = f"was killed by {name}" + (" (as the OOM killer kills)" if -code == signal.SIGKILL else "")
    else:
        how = f"exited with status {code}"
    return f"loader worker {index} of {count} (pid {worker.pid}) {how}"


_QUALIFIED = re.compile(r"^(?:[A-Za-z_]\w*\.)+(\w+: )")  # how a traceback names a package's exception class


def failure(exc: BaseException) -> Optional[str]:
    """One line for a loader worker's failure that ``exc`` reports, or None if it reports none."""
    text = str(exc)
    expired = [w.expired for w in list(_WATCHES) if w.expired]
    if expired and "DataLoader" in text:
        return expired[0]
    raised = re.search(r"Caught (\w+) in DataLoader worker process (\d+)", text)
    if raised:
        lines = [line for line in text.strip().splitlines() if line.strip()]
        last = lines[-1].strip() if lines else raised.group(1)
        last = _QUALIFIED.sub(r"\1", last)  # "naflex_accum.data.samples.ShardReadError: ..." as "ShardReadError: ..."
        return f"loader worker {raised.group(2)} raised {last}"
    if "DataLoader worker" not in text:
        return None
    dead = [_ended(i, n, w) for i, n, w in _workers() if w.exitcode not in (None, 0)]
    return "; ".join(dead) if dead else f"a loader worker ended: {' '.join(text.split())}"


def _kill(processes) -> None:
    """SIGKILL each of ``processes`` (multiprocessing children) that is still alive."""
    for process in processes:
        if process.is_alive():
            try:
                os.kill(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def stop(processes) -> None:
    """SIGKILL the worker ``processes`` (``of``) still alive, then let their iterator release its queues; their
    SIGCHLD reports are dropped (a stop on purpose is no failure for the next batch to raise)."""
    _kill(processes)
    for iterator, group in list(_LIVE.items()):
        if any(w in group for w in processes):
            del _LIVE[iterator]
            _kill(group)  # all of them: one killed inside its done event's is_set() holds the event's lock for ever,
            iterator._workers_done_event = threading.Event()  # so the shutdown sets a new one (no worker reads it)
            try:  # torch shuts an iterator's workers down from its __del__ only: at a chosen moment, by this
                iterator._shutdown_workers()  # (it also unregisters their pids from torch's SIGCHLD handler)
            except Exception:  # its queues may be broken by a failure; the processes are gone either way
                pass
    stopped = {str(w.pid) for w in processes}
    _PENDING[:] = [exc for exc in _PENDING if _reported_pid(exc) not in stopped]


def _reported_pid(exc: BaseException) -> Optional[str]:
    found = re.search(r"DataLoader worker \(pid (\d+)\)", str(exc))  # torch's SIGCHLD handler's wording
    return found.group(1) if found else None


def stop_all() -> None:
    """``stop`` every registered iterator, and kill any worker left: none of this process's is left alive."""
    for group in list(_LIVE.values()):
        stop(group)
    _kill(_PROCESSES)
    for process in _PROCESSES:
        process.join(timeout=5)
    _PROCESSES.clear()
