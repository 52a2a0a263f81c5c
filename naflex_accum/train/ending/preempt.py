"""Stop requests: SIGTERM, SIGUSR1 or a ``STOP`` file mean "finish this optimizer step, save, exit".

Invariants: a request is honoured only at an optimizer-step boundary, through the loop's check that every
rank takes at the same step, then exit ``EXIT_STOPPED``. At the start only a ``STOP`` older than the launch
is removed, and a served one is removed. Loader workers ignore both signals (SLURM signals the whole group).
In a process that ends with the run (``ends_process``), a signal after the run has saved is ignored, so a
teardown SIGTERM cannot turn a saved run into a killed one. docs/long-runs.md, "Stop requests".
"""
import contextlib
import logging
import math
import os
import select
import signal
import stat
import threading
import time
from pathlib import Path
from typing import List

EXIT_STOPPED = 75  # sysexits' EX_TEMPFAIL: stopped on request after saving; run it again to continue
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
LAUNCHED_ENV = "NAFLEX_ACCUM_LAUNCHED"
# A STOP file this much older than the launch still counts (clocks differ a little; the launch's seconds are whole)
CLOCK_SKEW = 2.0
_IMPORTED = time.time()  # an upper bound on this process's start
log = logging.getLogger(__name__)


def process_start() -> float:
    """When this process started (epoch seconds), from /proc; where that cannot be read, when this module was."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime, in clock ticks since boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        started = time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return _IMPORTED
    return min(started, _IMPORTED)  # a container's own /proc/uptime (lxcfs) would put it later than it was


def launch_time() -> float:
    """The earliest of this process's start and ``$NAFLEX_ACCUM_LAUNCHED`` (a bad value: warned, not used)."""
    launched, value = process_start(), os.environ.get(LAUNCHED_ENV)
    if value:
        with contextlib.suppress(ValueError):
            if math.isfinite(when := float(value)):  # -inf would make every STOP file newer than the launch
                return min(launched, when)
        log.warning(f"${LAUNCHED_ENV}={value!r} is not a time in epoch seconds; ignored (this process's start "
                    f"counts as the launch)")
    return launched


class Preempted(Exception):
    """Raised by the loop after the step at which every rank agreed to stop."""

    def __init__(self, step_in_epoch: int):
        super().__init__(f"stop requested; leaving after step {step_in_epoch} of the epoch")
        self.step_in_epoch = step_in_epoch


class StopRequest:
    def __init__(self, stop_file: Path, world, ends_process: bool = False):
        self.stop_file = Path(stop_file)
        self.world, self.ends_process = world, ends_process
        self.signalled = None  # the name of the first signal received, or None
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame):
        self.signalled = self.signalled or signal.Signals(signum).name

    def clear(self) -> None:
        """Forget a STOP file older than this (re)start's launch (a requeue must not stop at once); a newer stands."""
        if not self.world.is_master:
            return
        try:
            info = self.stop_file.stat()
        except OSError:  # none there, or a link that loops: no request
            return
        if not stat.S_ISREG(info.st_mode):  # a folder named STOP would be taken for a request at every start
            log.warning(f"{self.stop_file} is not a file: it asks no stop (a stop request is a file: touch it)")
        elif info.st_mtime < launch_time() - CLOCK_SKEW:
            self.stop_file.unlink(missing_ok=True)
            log.info(f"Removed {self.stop_file}, a stop request from before this start")
        else:
            log.info(f"{self.stop_file} was written after this start was launched: stopping after the first step")

    def served(self) -> None:
        """The run saved after the request: remove the STOP file (rank 0), a request that has been answered."""
        if self.world.is_master and self.stop_file.is_file():
            self.stop_file.unlink(missing_ok=True)

    def pending(self) -> bool:
        """This rank's request (a signal, or on rank 0 the STOP file); the loop's check makes it everyone's."""
        return self.signalled is not None or (self.world.is_master and self.stop_file.is_file())

    def reason(self) -> str:
        if self.signalled:
            return self.signalled
        return "the STOP file" if self.world.is_master and self.stop_file.is_file() else "another rank's request"

    def close(self) -> None:
        restore_handlers(self._previous, self.ends_process)
        self._previous = {}


def restore_handlers(previous: dict, ends_process: bool) -> None:
    """The handlers ``previous`` held, or, in a process that ends with the run, none (a late signal is ignored)."""
    for sig, handler in previous.items():
        signal.signal(sig, signal.SIG_IGN if ends_process else handler)


class Signals:
    """SIGTERM and SIGUSR1 seen by the listener through the wakeup fd, even while the main thread is blocked
    in a collective; until ``StopRequest`` takes them over, ``handler`` stands in for death before a word."""

    def __init__(self, ends_process: bool):
        self.ends_process, self.previous, self.handler = ends_process, {}, lambda signum, frame: None
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.write_fd, False)
        if threading.current_thread() is threading.main_thread():  # else no signal is seen, and none is taken
            signal.set_wakeup_fd(self.write_fd, warn_on_full_buffer=False)
            self.previous = {sig: signal.signal(sig, self.handler) for sig in SIGNALS}

    def wait(self, timeout: float) -> List[int]:
        """Sleep up to ``timeout`` s, waking at a signal (or ``wake``); the SIGTERMs and SIGUSR1s that came."""
        ready = select.select([self.read_fd], [], [], timeout)[0]
        return [s for s in os.read(self.read_fd, 512) if s in [int(sig) for sig in SIGNALS]] if ready else []

    def wake(self) -> None:
        with contextlib.suppress(OSError):  # full: the wait ends anyway
            os.write(self.write_fd, b"\0")

    def restore(self, unread: bool) -> None:
        """The previous handlers back (``restore_handlers``), and the wakeup fd off."""
        restore_handlers(self.previous, self.ends_process)
        if self.previous:
            signal.set_wakeup_fd(-1)
        if unread:  # else a late read could meet the descriptor's number reused by another file
            os.close(self.read_fd)
            os.close(self.write_fd)
