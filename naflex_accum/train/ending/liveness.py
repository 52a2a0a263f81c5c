"""Every rank is heard: the first failure is recorded once in the job's store, and every rank ends with it.

Invariants: a rank waits on its peers as long as torch's collective timeout (``World`` sets it per phase). The
first failure recorded (one line naming its rank, its exit class) is every rank's, printed once by rank 0 (rank 1
when rank 0 is gone). Each rank's listener thread beats in the store every second, as a rank in a roll call does
(no beat in ``ROLL_CALL`` s: gone or frozen), hears SIGTERM at once and ends its process when the main thread cannot.
No store call waits past ``ACK_WAIT``. docs/distributed.md, "When a rank fails, freezes or is killed".
"""
import contextlib
import json
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from concurrent import futures
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Callable, List, Optional

import torch.distributed as dist

from ...errors import QuietUsageError, UsageError, first_line, last_word, record_exit
from ...interrupt import EXIT_INTERRUPTED
from .exits import EXIT_LOADER, transient
from ..output.logs import log_file_only
from .preempt import EXIT_STOPPED, Signals

ROLL_CALL = 8.0  # seconds a roll call waits for every rank's beat
ACK_WAIT = 10.0  # the most a store call, or a wait for a rank to say it has seen the failure, takes
TAKEOVER = 5.0  # seconds the main thread gets to end the process itself once the listener knows the failure
# What a collective raises when a peer is gone or does not answer (gloo's errors name its sources)
COMM_MARKERS = ("/gloo/", "Connection reset by peer", "Connection closed by peer", "caused pair closure", "NCCL")
STUCK = (TimeoutError, ConnectionError)  # what a store call raises when the store gives no answer, or is gone


class Decided(Exception):
    """Raised in the loop at a step boundary once the listener knows how this rank ends: no step or save after it."""


@dataclass(eq=False)
class Failure(Exception):
    """How the job ends: raised where the run handles a failure (its data loader's), recorded once in the job's
    store, raised again by ``end_with`` on every rank once its line was printed where it had to be."""
    rank: int  # the rank that failed
    code: int  # the exit class every rank ends with
    line: str  # one line, naming the rank
    text: str = ""  # a UsageError's own message: ranks that met the same one print it once, bare
    announcer: int = 0  # the rank that prints it: rank 0, unless rank 0 is the rank that is gone


def own_failure(exc: BaseException, rank: int) -> Optional[Failure]:
    """The failure ``exc`` is on this rank, or None when it only says that a peer is gone or silent."""
    if isinstance(exc, Failure):
        return exc
    what = transient(exc)
    if what is not None:
        return Failure(rank, EXIT_LOADER, f"rank {rank}: {what} (exit {EXIT_LOADER})", text=what)
    if isinstance(exc, UsageError):
        return Failure(rank, 2, f"rank {rank}: {exc}", text=str(exc))
    if isinstance(exc, KeyboardInterrupt):
        return Failure(rank, EXIT_INTERRUPTED, f"rank {rank} was interrupted (SIGINT)")
    broken = isinstance(exc, RuntimeError) and any(m in str(exc) for m in COMM_MARKERS)
    if broken or isinstance(exc, (dist.DistError, Decided)):
        return None
    return Failure(rank, 1, f"rank {rank} failed: {first_line(exc, named=True)} (a bug: the traceback "
                            f"is in rank {rank}'s output)")


def ranks_text(ranks: List[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


class Liveness:
    """This rank's side: the main thread's calls, and the listener thread (``run``)."""

    def __init__(self, world, address: tuple, timeout: float, prog: str, ends_process: bool = False):
        self.rank, self.world_size, self.address, self.timeout, self.prog = \
            world.rank, world.world_size, address, timeout, prog
        self.hosts_store = world.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True)
        client = dist.TCPStore(*address, None, is_master=False, timeout=timedelta(seconds=ACK_WAIT),
                                wait_for_workers=False)
        self.store = dist.PrefixStore(f"naflex_accum/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", client)
        self.lock, self.closed, self.once = threading.Lock(), threading.Event(), threading.Lock()
        self.decision: Optional[Failure] = None
        self.ending = threading.Event()  # the main thread began ending (it then ends the process itself)
        self.gone, self.stuck = set(), None  # stuck: how the store failed (TimeoutError, ConnectionError)
        self.context: Callable[[], str] = lambda: "nothing was trained; run it again"
        self.flushers: List[Callable[[], None]] = []  # what to flush if the listener ends the process
        self.signals = Signals(ends_process)
        self.thread = threading.Thread(target=self.run, name="naflex-accum-listener", daemon=True)
        self.thread.start()

    def ask(self, fn):
        """``fn()`` on the store: ``ConnectionError`` when its host is gone, ``TimeoutError`` without an answer in
        ``ACK_WAIT`` s (the store's own timeout does not bound a call to a frozen host); after either, at once (each
        call to a frozen store would wait its ``ACK_WAIT`` s)."""
        if self.stuck:
            raise self.stuck("the job's store")
        answer = futures.Future()

        def call():
            try:
                answer.set_result(fn())
            except dist.DistError:
                answer.set_exception(ConnectionError("the job's store"))
            except BaseException as exc:  # handed to the caller's thread
                answer.set_exception(exc)
        threading.Thread(target=call, daemon=True).start()
        try:
            return answer.result(ACK_WAIT)  # a late answer changes nothing
        except (*STUCK, futures.TimeoutError) as failed:  # futures': not the builtin TimeoutError before Python 3.11
            self.stuck = ConnectionError if isinstance(failed, ConnectionError) else TimeoutError
        raise self.stuck("the job's store") from None

    def record(self, failure: Optional[Failure] = None) -> Optional[Failure]:
        """``failure`` recorded unless one is already; the first either way (None: none, and none given)."""
        mine = json.dumps(asdict(failure)) if failure else ""
        raw = self.ask(lambda: self.store.compare_set("failure", "", mine))
        return Failure(**json.loads(raw)) if raw else None

    def beats(self, ranks: List[int]) -> dict:
        """This rank beats once; the beats of ``ranks`` so far (the listener's own beat reads none)."""
        def call():
            self.store.add(f"beat/{self.rank}", 1)
            return {r: self.store.add(f"beat/{r}", 0) for r in ranks}
        return self.ask(call)

    def missing(self) -> List[int]:
        """A roll call: the other ranks that do not beat within ``ROLL_CALL`` seconds (this rank beats as it waits)."""
        deadline = time.monotonic() + ROLL_CALL
        silent = self.beats([r for r in range(self.world_size) if r != self.rank])
        while silent and time.monotonic() < deadline:
            time.sleep(0.2)
            if self.record() is not None:  # a failure recorded meanwhile says what happened
                return []
            now = self.beats(list(silent))
            silent = {r: n for r, n in silent.items() if now[r] == n}
        self.gone |= set(silent)
        return sorted(silent)

    def seen(self, ranks: List[int], limit: float) -> bool:
        """Whether ``ranks`` (those not gone) said within ``limit`` s that they are done with the store (polled: the
        store's own ``wait`` would hold this rank's connection, and the listener's beats, that long)."""
        keys, deadline = [f"seen/{r}" for r in ranks if r not in self.gone], time.monotonic() + limit
        while not self.ask(lambda: self.store.check(keys)):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    def check(self) -> None:
        """At a step boundary: end here once the listener has decided how this rank ends (its line names the last
        checkpoint then: no step may go on, and no save, while the listener waits ``TAKEOVER`` for this thread)."""
        if self.decision is not None:
            raise Decided(self.decision.line)

    def decide(self, failure: Failure) -> Failure:
        """``failure`` becomes this rank's decision unless there is one; the decision."""
        with self.lock:
            self.decision = self.decision or failure
            return self.decision

    def end_with(self, exc: BaseException):
        """Raise what this rank ends with after ``exc``: the first failure recorded, in its exit class."""
        self.ending.set()
        mine = None if isinstance(exc, QuietUsageError) else own_failure(exc, self.rank)
        try:
            if isinstance(exc, QuietUsageError):  # rank 0's own error, which it prints
                self.decide(Failure(0, 2, str(exc), text=str(exc)))
            elif self.decision is None:
                self.decide(self.record(mine) if mine is not None else self.after_comm_error(exc))
        except STUCK as stuck:
            self.decide(mine or self.store_gone(stuck))
        first = self.decision
        last_word(self.told(first))
        own = mine is not None and (first.rank == self.rank or (bool(mine.text) and mine.text == first.text))
        if self.rank == first.announcer and not own:
            self.announce(first)
        self.done()
        try:
            if own and self.rank != 0 and first.rank == self.rank and first.code != 1 and not self.seen([0], ACK_WAIT):
                self.announce(first)  # rank 0 is not there to print it
            if self.hosts_store:
                self.seen(list(range(1, self.world_size)), ACK_WAIT)
        except STUCK:
            if own and self.rank != 0 and mine.code != 1:
                self.announce(first)
        if own and (self.rank == 0 or mine.code == 1):
            raise exc  # printed as one process prints it: by the CLI, or with its traceback (a bug)
        if first.code == 2:
            raise QuietUsageError(first.line) from None
        raise first from None

    def after_comm_error(self, exc: BaseException) -> Failure:
        """The failure behind a collective that broke: a peer's record, else the ranks that miss a roll call."""
        recorded = self.record()
        missing = [] if recorded else self.missing()  # a failure recorded: no roll call to wait out
        recorded, after = recorded or self.record(), f"{self.context()} (exit {EXIT_LOADER})"
        waited = "imed out" in str(exc) or "timeout" in str(exc).lower()
        if recorded is not None:
            return recorded
        if missing and waited:
            line = (f"{ranks_text(missing)} stopped answering: a collective waited --dist-timeout ({self.timeout:g} s) "
                    f"and a roll call {ROLL_CALL:g} s (a stopped or frozen process); {after}")
        elif missing:
            line = f"{ranks_text(missing)} ended without a word (killed? the OOM killer sends SIGKILL); {after}"
        else:
            line = (f"rank {self.rank}: a collective " + (f"waited --dist-timeout ({self.timeout:g} s)" if waited else
                    f"failed ({first_line(exc)})") + " while every rank answers a roll call (one stuck in I/O, or in a "
                    f"loader slower than --data-timeout?); {after}")
        return self.record(Failure(missing[0] if missing else self.rank, EXIT_LOADER, line,
                                   announcer=int(missing[:1] == [0])))

    def store_gone(self, stuck: OSError) -> Failure:
        """This rank's own account when the store is gone or stuck: so is its host (rank 0 under srun)."""
        after, gone = f"{self.context()} (exit {EXIT_LOADER})", isinstance(stuck, ConnectionError)
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
            return Failure(0, EXIT_LOADER, (f"rank 0 ended without a word (killed? the OOM killer sends SIGKILL)" if
                           gone else f"rank 0 stopped answering: the job's store it serves gave no answer for "
                           f"{ACK_WAIT:g} s (a stopped or frozen process)") + f"; {after}", announcer=1)
        return Failure(self.rank, EXIT_LOADER, f"the job's store at {self.address[0]}:{self.address[1]} (torchrun's "
                       f"agent on rank 0's node) {'closed' if gone else 'does not answer'}: the launcher or the job "
                       f"ended around this rank; {after}")

    def announce(self, failure: Failure) -> None:
        if not self.once.acquire(blocking=False):  # announced already
            return
        print(self.told(failure), file=sys.stderr, flush=True)
        if self.rank == 0:
            with contextlib.suppress(Exception):  # out.log unwritable: stderr has the line, and nothing may hide it
                log_file_only(failure.line)

    def told(self, failure: Failure) -> str:  # a stop on request is no error
        return f"{self.prog}: {'' if failure.code == EXIT_STOPPED else 'error: '}{failure.line}"

    def done(self) -> None:
        """Say that this rank will not call the store again (rank 0 under srun serves it until all have)."""
        with contextlib.suppress(*STUCK):
            self.ask(lambda: self.store.set(f"seen/{self.rank}", ""))

    def close(self, ok: bool) -> None:
        """At this rank's end: stop the listener, say so; a rank that serves the store waits for the others."""
        self.closed.set()
        self.signals.wake()
        self.thread.join(timeout=ACK_WAIT + 2)
        if not self.ending.is_set():
            self.done()
            if self.hosts_store and ok:
                with contextlib.suppress(*STUCK):
                    self.seen(list(range(1, self.world_size)), self.timeout)
        self.signals.restore(unread=not self.thread.is_alive())

    def run(self) -> None:
        while not self.closed.is_set():  # beating on while the main thread ends too
            caught = self.signals.wait(1.0)
            try:
                first = self.record()
                self.beats([])
                if first is None and caught and not self.ending.is_set():
                    first = self.signalled(caught[0])
            except STUCK as stuck:
                first = self.store_gone(stuck)
            if first is not None and not self.ending.is_set():
                self.conclude(first)

    def signalled(self, signum: int) -> Optional[Failure]:
        """A SIGTERM or SIGUSR1: with a rank not answering nothing can be saved; during start-up, a stop."""
        ours = signal.getsignal(signum) is self.signals.handler  # the loop's StopRequest has not taken it over
        missing, name, after = self.missing(), signal.Signals(signum).name, self.context()
        if missing:
            return self.record(Failure(missing[0], EXIT_LOADER, (
                f"{ranks_text(missing)} has not answered for {ROLL_CALL:g} s (killed or frozen) and rank {self.rank} "
                f"got {name}: nothing can be saved without every rank; {after} (exit {EXIT_LOADER})"),
                announcer=int(missing[0] == 0)))
        if ours:
            return self.record(Failure(self.rank, EXIT_STOPPED, f"rank {self.rank} got {name} during start-up; "
                                       f"{after} (exit {EXIT_STOPPED})"))
        return None

    def conclude(self, failure: Failure) -> None:
        """End this rank with ``failure`` (the main thread, if it begins to within ``TAKEOVER``, does)."""
        failure = self.decide(failure)
        last_word(self.told(failure))
        if self.rank == failure.announcer:
            self.announce(failure)
        self.done()
        if not self.ending.wait(TAKEOVER):
            end_process(failure.code, self.flushers)


def end_process(code: int, flushers=()) -> None:
    """Exit now, from the listener (the main thread is blocked or busy): the exit file and logs written, no loader
    worker left (those that take the parent-death signal would go anyway; a forkserver's would not)."""
    for child in multiprocessing.active_children():
        child.kill()
    for flush in [*flushers, lambda: record_exit(code, last_word()), logging.shutdown, sys.stdout.flush]:
        with contextlib.suppress(Exception):  # an unwritable log must not keep the process from ending
            flush()
    os._exit(code)
