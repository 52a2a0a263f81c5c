"""Every rank is heard: the job's store carries each rank's first failure, its heartbeat and its goodbye.

Invariants: a run of several processes opens the job's store itself, where env:// would (torchrun's
agent serves it at MASTER_ADDR:MASTER_PORT, or else rank 0 does, from a process of its own:
``storehost``), and keeps a side channel there next to the process group's keys. The first failure
any rank records (one line naming the rank, and its exit class) is the one every rank ends with; it
is printed once, by rank 0 (by rank 1 when rank 0 is the rank that is gone), on stderr and in
out.log, and a rank that failed and is still there prints it itself when rank 0 does not
acknowledge it; an error every rank meets alike is printed once, as one process prints it. A rank
whose collective breaks because a peer is gone ends with the recorded failure, or, when none comes
within a moment, names the peers whose heartbeat stopped. What rank 0 does alone while the others
wait (``share``: its evaluations, its checkpoint writes) is waited for on the store for as long as
rank 0 is alive, never in a collective that could time out. Every rank says goodbye (``bye:CODE``)
before it leaves. A child a rank forks keeps none of its network connections, so a rank's death
closes them for its peers at once. One process has none of this and pays nothing for it.
"""
import os
import pickle
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import Callable, Dict, List, Optional

import torch.distributed as dist

from ..errors import QuietUsageError, UsageError, last_word
from ..interrupt import EXIT_INTERRUPTED
from . import storehost
from .channel import Channel, Failure, Pulse
from .exits import EXIT_LOADER, transient
from .logs import log_file_only
from .preempt import EXIT_STOPPED

DEFAULT_TIMEOUT = 600.0  # --dist-timeout's default (docs/distributed.md says why)
COLLECTIVE_MARGIN = 30.0  # a collective waits --dist-timeout + this: a rank stuck on its loader names itself first
ACK_WAIT = 10.0  # seconds a failing rank waits for rank 0 to acknowledge its record, and rank 0 for goodbyes
QUIET_FOR = 8.0  # a heartbeat that has not moved for this long (at most --dist-timeout): the rank is gone
# What a collective raises when a peer is gone or does not answer: gloo's errors are plain RuntimeErrors
# that name its sources; NCCL's and the store's are DistErrors.
COMM_MARKERS = ("/gloo/", "Connection reset by peer", "Connection closed by peer", "pair closure", "NCCL")


class RankFailure(Exception):
    """This rank failed in a way the run handles (one line, an exit class), e.g. its data loader."""

    def __init__(self, line: str, code: int):
        super().__init__(line)
        self.line, self.code = line, code


class RankEnded(Exception):
    """This rank ends with exit status ``code``; its line was printed where it had to be."""

    def __init__(self, code: int):
        super().__init__(f"exit {code}")
        self.code = code


class PeerEnded(Exception):
    """Raised on the main thread, in a wait on the store, once a failure is known (``Peers.decision``)."""


def is_comm_error(exc: BaseException) -> bool:
    return isinstance(exc, dist.DistError) or (
        isinstance(exc, RuntimeError) and any(marker in str(exc) for marker in COMM_MARKERS))


def first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def own_failure(exc: BaseException, rank: int) -> Optional[Failure]:
    """The failure ``exc`` is on this rank, or None when it only says that a peer is gone."""
    if isinstance(exc, RankFailure):
        return Failure(rank, exc.code, exc.line)
    what = transient(exc)
    if what is not None:
        return Failure(rank, EXIT_LOADER, f"rank {rank}: {what} (exit {EXIT_LOADER})", text=what)
    if isinstance(exc, UsageError):
        return Failure(rank, 2, f"rank {rank}: {exc}", text=str(exc))
    if isinstance(exc, KeyboardInterrupt):
        return Failure(rank, EXIT_INTERRUPTED, f"rank {rank} was interrupted (SIGINT)")
    if is_comm_error(exc):
        return None
    return Failure(rank, 1, f"rank {rank} failed: {type(exc).__name__}: {first_line(exc)} (a bug: the traceback "
                            f"is in rank {rank}'s output)")


def ranks_text(ranks: List[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


class Peers:
    """This rank's side of the channel: the main thread's API (the watchdog thread is ``watchdog.Watchdog``)."""

    def __init__(self, world, store, address: tuple, timeout: float, prog: str, ends_process: bool = False):
        from .watchdog import StoreLink, Watchdog  # watchdog uses this module's classes

        self.rank, self.world_size = world.rank, world.world_size
        self.address, self.timeout, self.prog = address, timeout, prog
        self.ends_process = ends_process  # the watchdog's signal handlers are left ignoring (preempt.StopRequest)
        self.prefix, self.store, self.link = channel_prefix(), store, StoreLink(address)
        self.main = Channel(dist.PrefixStore(self.prefix, store), world.world_size, self.store_gone)
        _FORKING_RANK[0] = True
        self.quiet_for = min(QUIET_FOR, timeout)
        self.lock = threading.Lock()
        self.decision: Optional[Failure] = None  # the failure this rank ends with, once known
        self.main_ending: Optional[float] = None  # when the main thread began ending (it then ends the process)
        self.announced = self.said_bye = False
        self.shares = 0
        self.context: Callable[[], str] = lambda: "nothing was trained; run it again"
        self.flushers: List[Callable[[], None]] = []  # what to flush if the watchdog ends the process
        self.main.beat(self.rank, "0")
        self.watchdog = Watchdog(self)
        self.watchdog.start()

    @property
    def collective_timeout(self) -> timedelta:
        return timedelta(seconds=self.timeout + COLLECTIVE_MARGIN)

    def pg_store(self):
        """The store for ``init_process_group``, under the prefix env:// gives it."""
        return dist.PrefixStore("default_pg", self.store)

    # ---- rank 0's solo phases -------------------------------------------------------------------------------

    def share(self, obj):
        """Rank 0's ``obj`` on every rank, the others waiting on the store while rank 0 works alone."""
        key = f"share/{self.shares}"
        self.shares += 1
        if self.rank == 0:
            self.main.store.set(key, pickle.dumps(obj))
            return obj
        delay = 0.002
        while not self.main.store.check([key]):
            if self.decision is not None:
                raise PeerEnded()
            time.sleep(delay)
            delay = min(2 * delay, 0.2)
        return pickle.loads(self.main.store.get(key))

    # ---- ending ----------------------------------------------------------------------------------------------

    def decide(self, failure: Failure) -> Optional[Failure]:
        """``failure`` becomes this rank's decision unless there is one; None when there was."""
        with self.lock:
            if self.decision is not None:
                return None
            self.decision = failure
            return failure

    def end_with(self, exc: BaseException):
        """Raise what this rank ends with after ``exc``: the first failure recorded, in its exit class."""
        self.main_ending = time.monotonic()
        mine = None
        if self.decision is None and not isinstance(exc, PeerEnded):
            if isinstance(exc, QuietUsageError):  # rank 0's own error, which it prints
                first = Failure(0, 2, str(exc), text=str(exc))
            else:
                mine = own_failure(exc, self.rank)
                try:
                    if self.store_gone():  # not even asked: a store call to a dead host prints torch's traceback
                        raise dist.DistNetworkError("the job's store is gone")
                    first = self.main.record(mine) if mine is not None else self.after_comm_error(exc)
                except dist.DistError:
                    first = mine if mine is not None else self.store_gone_failure()
            self.decide(first)
        first = self.decision
        last_word(self.told(first))
        own = mine is not None and (first.rank == self.rank or (bool(mine.text) and mine.text == first.text))
        try:
            self.settle(first, self.main, own=own)
        except dist.DistError:  # the store went with its host: print what this rank knows, if it is to
            if self.rank == first.announcer and not own or own and self.rank != 0 and mine.code != 1:
                self.announce(first)
        if own and (self.rank == 0 or mine.code == 1):
            if isinstance(exc, RankFailure):  # rank 0's loader failure: already in its log
                raise RankEnded(exc.code) from None
            raise exc  # printed as one process prints it: by the CLI, or with its traceback (a bug)
        if first.code == 2:
            raise QuietUsageError(first.line) from None
        raise RankEnded(first.code) from None

    def settle(self, first: Failure, channel: Channel, own: bool = False) -> None:
        """Print ``first`` if this rank is to, say goodbye, and wait for what must come before leaving.

        ``own``: ``first`` is this rank's own failure; rank 0 prints its own the way one process does, and
        another rank prints its own when rank 0 does not acknowledge it (a bug's traceback is its own line)."""
        if self.rank == first.announcer and not own:
            self.announce(first)
        self.bye(channel, first.code)
        if own and self.rank != 0 and first.rank == self.rank and first.code != 1:
            if self.wait_beats(channel, [0], ACK_WAIT).get(0) != str(first.code):
                self.announce(first)  # rank 0 is not there to print it

    def announce(self, failure: Failure) -> bool:
        with self.lock:
            if self.announced:
                return False
            self.announced = True
        print(self.told(failure), file=sys.stderr, flush=True)
        if self.rank == 0:
            try:
                log_file_only(failure.line)
            except Exception:  # out.log unwritable: stderr has the line, and nothing may hide it
                pass
        return True

    def told(self, failure: Failure) -> str:
        kind = "" if failure.code == EXIT_STOPPED else "error: "  # a stop on request is no error
        return f"{self.prog}: {kind}{failure.line}"

    def bye(self, channel: Channel, code) -> None:
        with self.lock:
            if self.said_bye:
                return
            self.said_bye = True
        channel.beat(self.rank, f"bye:{code}")

    def wait_beats(self, channel: Channel, ranks: List[int], limit: float) -> Dict[int, str]:
        """Wait up to ``limit`` s for ``ranks`` to say goodbye, or to go quiet; the codes of those that did."""
        deadline, pulse, byes = time.monotonic() + limit, Pulse(), {}
        while True:
            now = time.monotonic()
            pulse.update(channel.beats(ranks), now)
            byes = {r: pulse.said_bye(r) for r in ranks if pulse.said_bye(r) is not None}
            waiting = set(ranks) - set(byes) - set(pulse.quiet(now, self.quiet_for))
            if not waiting or now >= deadline:
                return byes
            time.sleep(0.05)

    def store_gone(self) -> bool:
        """Whether the store's host is gone (the idle link to it closed)."""
        return self.link.gone()

    def store_gone_failure(self) -> Failure:
        """Every rank's own account (rank 0 prints it): the store is gone, and with it the run's way to agree."""
        host, port = self.address
        holder = "torchrun's agent on rank 0's node" if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == \
            str(True) else "rank 0's store process"
        return Failure(self.rank, EXIT_LOADER, f"the job's store at {host}:{port} ({holder}) closed: the launcher "
                       f"or the job ended around this rank; {self.context()} (exit {EXIT_LOADER})")

    def after_comm_error(self, exc: BaseException) -> Failure:
        """The failure behind a collective that broke: the one a peer records within a moment, else the peers
        whose heartbeat stopped, else this rank's own account."""
        deadline, pulse = time.monotonic() + self.quiet_for + 1.0, Pulse()
        others = [r for r in range(self.world_size) if r != self.rank]
        while time.monotonic() < deadline:
            recorded = self.main.first()
            if recorded is not None:
                return recorded
            pulse.update(self.main.beats(others), time.monotonic())
            time.sleep(0.2)
        quiet = pulse.quiet(time.monotonic(), self.quiet_for)
        timed_out = "Timed out" in str(exc) or "timeout" in str(exc).lower()
        if quiet:
            line = frozen_line(quiet, self.quiet_for, self.context()) if timed_out else \
                ended_line(quiet, self.context())
            found = Failure(quiet[0], EXIT_LOADER, line, alive=False)
        elif timed_out:
            found = Failure(self.rank, EXIT_LOADER, f"rank {self.rank}: a collective waited "
                            f"{self.collective_timeout.total_seconds():g} s (--dist-timeout + {COLLECTIVE_MARGIN:g}) "
                            f"for a rank that is alive but did not join it (stuck in I/O, or in a loader slower than "
                            f"--data-timeout allows); {self.context()} (exit {EXIT_LOADER})")
        else:
            found = Failure(self.rank, EXIT_LOADER, f"rank {self.rank}: a collective failed while every rank is "
                            f"alive ({first_line(exc)}); {self.context()} (exit {EXIT_LOADER})")
        return self.main.record(found)

    def close(self, code=0) -> None:
        """At this rank's end: stop the watchdog, say goodbye (the store's process waits for every goodbye)."""
        self.watchdog.stop()
        try:
            self.bye(self.main, code)
        except dist.DistError:  # the store is gone: nobody is left to tell
            pass
        self.watchdog.signals.restore(unread=not self.watchdog.is_alive())
        _FORKING_RANK[0] = False


_FORKING_RANK = [False]  # this process is a rank of a run of several processes


def channel_prefix() -> str:
    """The side channel's keys (torchrun's agent keeps its store across the restarts it makes: one per start)."""
    return f"naflex_accum/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _leave_connections_behind() -> None:
    """In a child forked from a rank (a loader worker): close its copies of the rank's network connections
    (gloo's, the store's) and of rank 0's store lifeline, so that the rank's death closes them for its peers
    at once, not when the child ends (a loader worker notices its parent's death only seconds later)."""
    if not _FORKING_RANK[0]:
        return
    for fd in storehost.LIFELINES:
        try:
            os.close(fd)
        except OSError:
            pass
    storehost.LIFELINES.clear()
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:  # not Linux: the children keep them, and a rank's death is seen when they end
        return
    for fd in fds:
        try:
            sock = socket.socket(fileno=fd)
        except OSError:  # not a socket (or the listing's own descriptor, closed by now)
            continue
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.close()
        else:
            sock.detach()


os.register_at_fork(after_in_child=_leave_connections_behind)


def ended_line(ranks: List[int], after: str) -> str:
    return (f"{ranks_text(ranks)} ended without a word (killed? the OOM killer sends SIGKILL); {after} "
            f"(exit {EXIT_LOADER})")


def frozen_line(ranks: List[int], seconds: float, after: str, flag: str = "") -> str:
    return (f"{ranks_text(ranks)} stopped answering: no heartbeat for {seconds:g} s{flag} (a stopped or frozen "
            f"process); {after} (exit {EXIT_LOADER})")
