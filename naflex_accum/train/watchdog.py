"""The per-rank watchdog thread: heartbeats, a peer frozen past --dist-timeout, SIGTERM while blocked.

Invariants: the thread never waits on the store for longer than a bound (a ``TCPStore`` client's
set, check and get have no timeout of their own: against a frozen host they wait for ever), so a
rank ends within --dist-timeout plus a few seconds of a peer's (or the store host's) last sign of
life; it ends the process itself only when the main thread cannot (blocked in C, in a collective
with a frozen peer, or busy elsewhere: its evaluation) and, given a moment, has not begun to end it;
a SIGTERM or SIGUSR1 is seen here the moment it arrives, through the signal wakeup fd, even while the
main thread is blocked: with a peer gone quiet nothing can be saved, so the rank ends at once with
one line; with every peer alive it is the run's stop request, honoured by the loop as ever; before
the loop takes signals over, one that no failure explains ends the start-up (exit 75, nothing
to save). Any failure this thread meets is recorded in the store first, so every rank ends with it.
"""
import logging
import multiprocessing
import os
import select
import signal
import socket
import sys
import threading
import time
from typing import Optional

import torch.distributed as dist

from .channel import GONE, Channel, Failure, Pulse
from .ending.exits import EXIT_LOADER
from .output.logs import LOGGER_NAME
from .peers import ACK_WAIT, ended_line, frozen_line, ranks_text
from .ending.preempt import EXIT_STOPPED, SIGNALS

TAKEOVER = 5.0  # seconds the main thread gets to end the process itself once a failure is decided
MAIN_ENDING_LIMIT = 30.0  # a main thread that began ending this long ago and has not: this thread ends it


class Stuck(Exception):
    """A store call did not return within its bound."""


class Bounded:
    """Store calls that cannot hang the watchdog: each runs on a helper thread joined with a timeout; while
    one hangs the store counts as stuck (no second call queues behind it)."""

    def __init__(self):
        self.busy: Optional[threading.Thread] = None

    def __call__(self, fn, limit: float):
        if self.busy is not None and self.busy.is_alive():
            raise Stuck()
        box = {}

        def call():
            try:
                box["value"] = fn()
            except BaseException as exc:  # handed to the watchdog, which knows what a store error means
                box["error"] = exc
        thread = threading.Thread(target=call, name="naflex-accum-store-call", daemon=True)
        thread.start()
        thread.join(limit)
        if thread.is_alive():
            self.busy = thread
            raise Stuck()
        if "error" in box:
            raise box["error"]
        return box.get("value")


class Signals:
    """SIGTERM and SIGUSR1 as the watchdog sees them: Python runs a handler only on the main thread between
    bytecodes, never while it is blocked in a collective, but the C-level handler also writes the signal's
    number to the wakeup fd, which this thread reads. Until the run's ``StopRequest`` takes the signals
    over, the handler here stands in for their default action, which would kill the process before it
    could say why (torchrun sends SIGTERM to every rank the moment one fails)."""

    def __init__(self, ends_process: bool = False):
        self.read_fd: Optional[int] = None
        self.ends_process = ends_process  # restore() leaves the signals ignored (preempt.StopRequest)
        self.previous, self.caught = {}, []  # caught: [(signal number, time, whether ours)] not yet acted on
        self._handler = self._on_signal  # one object, so that ``getsignal(...) is self._handler`` holds
        if threading.current_thread() is not threading.main_thread():
            return
        read_fd, write_fd = os.pipe()
        os.set_blocking(read_fd, False)
        os.set_blocking(write_fd, False)
        if signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False) != -1:  # someone else's (asyncio): keep it
            signal.set_wakeup_fd(-1)
            os.close(read_fd)
            os.close(write_fd)
        else:
            self.read_fd, self.write_fd = read_fd, write_fd
        for sig in SIGNALS:
            self.previous[sig] = signal.signal(sig, self._handler)

    def _on_signal(self, signum, frame):
        if self.read_fd is None:  # no wakeup fd: this is all the watchdog learns, once the main thread runs
            self.caught.append((signum, time.monotonic(), True))

    def wait(self, timeout: float) -> None:
        """Sleep up to ``timeout`` s, waking at a signal; record SIGTERM and SIGUSR1."""
        if self.read_fd is None:
            time.sleep(timeout)
            return
        ready, _, _ = select.select([self.read_fd], [], [], timeout)
        if not ready:
            return
        try:
            data = os.read(self.read_fd, 512)
        except BlockingIOError:
            return
        for signum in data:
            if signum in [int(s) for s in SIGNALS]:
                self.caught.append((signum, time.monotonic(), signal.getsignal(signum) is self._handler))

    def wake(self) -> None:
        """End a wait now (a zero byte: no signal's number)."""
        if self.read_fd is not None:
            try:
                os.write(self.write_fd, b"\0")
            except OSError:  # full: the wait ends anyway
                pass

    def taken_over(self, signum: int) -> bool:
        """Whether a handler of the run's own (``StopRequest``) now takes ``signum``."""
        current = signal.getsignal(signum)
        return current is not self._handler and callable(current)

    def restore(self, unread: bool) -> None:
        """The previous handlers, or, in a process that ends with the run, none (a late signal is ignored).
        ``unread``: nothing reads the wakeup pipe any more, so it may close (else a reader could meet the
        descriptor's number reused by another file)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, handler in self.previous.items():
            signal.signal(sig, signal.SIG_IGN if self.ends_process else handler)
        self.previous = {}
        if self.read_fd is not None:
            signal.set_wakeup_fd(-1)
            if unread:
                os.close(self.read_fd)
                os.close(self.write_fd)
                self.read_fd = None


class StoreLink:
    """Whether the store's host is gone, seen without a store call (a store call to a dead host prints torch's
    C++ traceback): an idle socket to it reads end-of-file once the host's process is gone. torch 2.14's
    TCPStore server (libuv) never closes an idle connection; a host alive but frozen keeps it open (the
    bounded calls find that one)."""

    def __init__(self, address: tuple):
        self.lock, self.closed = threading.Lock(), False
        try:
            self.sock = socket.create_connection(address, timeout=5)
            self.sock.setblocking(False)
        except OSError:
            self.sock = None  # no link: the store calls are the only sign

    def gone(self) -> bool:
        with self.lock:
            if self.closed or self.sock is None:
                return self.closed
            if select.select([self.sock], [], [], 0)[0]:
                try:
                    self.closed = not self.sock.recv(64)
                except BlockingIOError:
                    pass
                except OSError:
                    self.closed = True
            return self.closed


class Watchdog(threading.Thread):
    def __init__(self, peers):
        super().__init__(name="naflex-accum-watchdog", daemon=True)
        self.peers, self.timeout = peers, peers.timeout
        self.interval = max(0.1, min(1.0, peers.timeout / 10))
        self.channel = None  # its own store client, made on this thread
        self.call, self.pulse, self.count, self.beat = Bounded(), Pulse(), 0, "0"  # beat: the value last written
        self.handover: Optional[float] = None  # when the run's StopRequest was first seen holding a caught signal
        self.signals = Signals(peers.ends_process)
        self.stuck_since: Optional[float] = None
        self.closed = threading.Event()
        self.others = [r for r in range(peers.world_size) if r != peers.rank]

    def stop(self) -> None:
        self.closed.set()
        self.signals.wake()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=2 * self.interval + 1)

    def run(self) -> None:
        last = time.monotonic()
        warned = False
        while not self.closed.is_set():
            try:
                self.signals.wait(self.interval)
                if self.closed.is_set():
                    break
                now = time.monotonic()
                if now - last > 3 * self.interval + 2:
                    self.pulse.reset(now)  # this process was stopped itself
                    self.stuck_since = None
                last = now
                self.tick(now)
            except Exception as exc:  # the watchdog must outlive its own surprises; say so once
                if not warned and not self.closed.is_set():
                    warned = True
                    print(f"naflex-accum: the rank {self.peers.rank} watchdog met {type(exc).__name__}: {exc}",
                          file=sys.stderr, flush=True)

    def _open_channel(self):
        store = dist.TCPStore(self.peers.address[0], self.peers.address[1], None, is_master=False,
                              timeout=self.peers.collective_timeout, wait_for_workers=False)
        return Channel(dist.PrefixStore(self.peers.prefix, store), self.peers.world_size, self.peers.store_gone)

    def tick(self, now: float) -> None:
        peers = self.peers
        if peers.main_ending is not None:  # the main thread is ending the process; keep beating meanwhile
            if now - peers.main_ending > MAIN_ENDING_LIMIT:
                end_process(peers.decision.code if peers.decision else EXIT_LOADER, peers.flushers)
            try:
                self.call(lambda: self._io(beat_only=True), limit=max(5.0, self.interval * 5))
            except (Stuck, dist.DistError):
                pass
            return
        if peers.decision is not None:
            return
        if peers.store_gone():
            return self._store_gone()
        try:
            first, beats = self.call(self._io, limit=max(5.0, self.interval * 5))
        except Stuck:
            self.stuck_since = self.stuck_since or now
            if now - self.stuck_since > self.timeout:
                self._store_stuck(now - self.stuck_since)
            return self._signalled(now)
        except dist.DistError:  # the connection to the store broke: its host is gone
            return self._store_gone()
        self.stuck_since = None
        if first is not None:
            return self.decide(first, record=False)
        gone = [rank for rank, value in beats.items() if value == GONE]
        if gone:  # rank 0's store process saw it go
            return self.decide(Failure(gone[0], EXIT_LOADER, ended_line(gone, peers.context()), alive=False))
        self.pulse.update(beats, now)
        frozen = self.pulse.quiet(now, self.timeout)
        if frozen:
            return self.decide(Failure(frozen[0], EXIT_LOADER, frozen_line(
                frozen, self.timeout, peers.context(), " (--dist-timeout)"), alive=False))
        self._signalled(now)

    def _io(self, beat_only: bool = False):
        if self.channel is None:
            self.channel = self._open_channel()
        if not self.peers.said_bye:  # never over a goodbye the main thread wrote meanwhile (compare-and-set)
            self.count += 1
            now = self.channel.beat_over(self.peers.rank, self.beat, str(self.count))
            self.beat = now if not now.startswith(("bye", GONE)) else self.beat
        if beat_only:
            return None, {}
        everyone = self.peers.rank == 0 or bool(self.signals.caught)
        return self.channel.first(), self.channel.beats(self.others if everyone else [0])

    def _signalled(self, now: float) -> None:
        """Act on a SIGTERM or SIGUSR1: a peer gone quiet means nothing can be saved; before the run's loop, a
        signal no failure explains ends the start-up."""
        if not self.signals.caught:
            return
        signum, at, ours = self.signals.caught[0]
        name, peers = signal.Signals(signum).name, self.peers
        quiet = self.pulse.quiet(now, peers.quiet_for)
        if quiet:
            return self.decide(Failure(quiet[0], EXIT_LOADER, (
                f"{ranks_text(quiet)} has not answered for {peers.quiet_for:g} s (killed or frozen) and rank "
                f"{peers.rank} got {name}: nothing can be saved without every rank; {peers.context()} "
                f"(exit {EXIT_LOADER})"), alive=False))
        if ours and self.signals.taken_over(signum):  # the run's StopRequest exists now: the request is its,
            if self.handover is not None:  # from the tick after it was first seen: its clear() has run
                signal.raise_signal(signum)
                ours = False
            self.handover = self.handover or now
        if ours and now - at > peers.quiet_for + 1:  # no failure came to explain it: a stop during start-up
            self.decide(Failure(peers.rank, EXIT_STOPPED, f"rank {peers.rank} got {name} during start-up; "
                                f"{peers.context()} (exit {EXIT_STOPPED})"))
        elif not ours:  # the loop's stop request: it is honoured there; keep watching the peers meanwhile
            self.signals.caught = [(signum, at, False)]

    def _store_gone(self) -> None:
        self.decide(self.peers.store_gone_failure(), record=False)

    def _store_stuck(self, seconds: float) -> None:
        peers, (host, port) = self.peers, self.peers.address
        self.decide(Failure(peers.rank, EXIT_LOADER, f"the job's store at {host}:{port} gave no answer for "
                            f"{seconds:.0f} s (--dist-timeout {self.timeout:g}); {peers.context()} "
                            f"(exit {EXIT_LOADER})"), record=False)

    def decide(self, failure: Failure, record: bool = True) -> None:
        """End this rank with the first failure (``failure``, unless the store holds an earlier one)."""
        peers = self.peers
        usable = self.channel is not None and not peers.store_gone()
        if record and usable:
            try:
                failure = self.call(lambda: self.channel.record(failure), limit=ACK_WAIT)
            except (Stuck, dist.DistError):
                usable = False  # the store cannot take it: this rank ends with its own account
        if peers.decide(failure) is None:
            return
        try:
            if not usable:
                raise Stuck()
            self.call(lambda: peers.settle(failure, self.channel), limit=2 * ACK_WAIT)
        except (Stuck, dist.DistError):
            if peers.rank == failure.announcer:
                peers.announce(failure)  # the store is gone or stuck: this rank prints what it knows
        deadline = time.monotonic() + TAKEOVER
        while time.monotonic() < deadline and peers.main_ending is None:
            time.sleep(0.05)
        if peers.main_ending is None:
            end_process(failure.code, peers.flushers)


def end_process(code: int, flushers=()) -> None:
    """Exit now, from this thread (the main thread is blocked or busy): what the run logged is flushed
    (``flushers``: tensorboard's events), and no loader worker is left behind."""
    for child in multiprocessing.active_children():
        child.kill()
    for flush in flushers:
        try:
            flush()
        except Exception:  # an unwritable log must not keep the process from ending
            pass
    for handler in logging.getLogger(LOGGER_NAME).handlers:
        try:
            handler.flush()
        except Exception:
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)
