"""Opening shards: ``pipe:`` commands run here, never outliving their reader; every other URL by webdataset's gopen.

Invariant: a ``pipe:`` command runs under ``/bin/sh -c`` in a process group of its own, led by a shell whose
parent-death signal kills the group, so it goes when its reader dies, however that dies; ``close`` kills the
group before reaping (no pid signalled after reuse), and a non-zero status after output read whole raises
``PipeFailed``. ``kill_all`` only signals (safe in a signal handler). docs/data.md, "``pipe:`` shards".
"""
import ctypes
import functools
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Optional

from webdataset.gopen import gopen

EXIT_GRACE = 2.0  # seconds a command whose output was read whole has to exit before it is killed, status unread
# Statuses of a command whose output was read whole that are no error: ended by SIGPIPE (the reader stops at the
# archive's end marker, before the padding after it), as such, or as sh reports it (128 + 13), as gopen's
_FINE = (0, -signal.SIGPIPE, 128 + signal.SIGPIPE)
_PR_SET_PDEATHSIG = 1
# The group's leader: the command in the background (passed as "$1": no quoting of it here; the leader's own stdout
# then let go, so the output ends when the command's does), and a trap that kills the whole group on SIGTERM (the
# parent-death signal), which interrupts ``wait`` at once (POSIX); the leader's status is the command's. A POSIX
# shell starts a background command with SIGINT and SIGQUIT ignored: bash can give them back, dash cannot.
_BASH = shutil.which("bash")
_BACKGROUND = '{ trap - INT QUIT; exec /bin/sh -c "$1"; } &' if _BASH else '/bin/sh -c "$1" &'
_LEADER = [_BASH or "/bin/sh", "-c", f'trap "kill -s KILL 0" TERM; {_BACKGROUND} exec >/dev/null; wait $!', "sh"]
_LIVE: set = set()  # this process's PipeStreams not closed yet


class PipeFailed(Exception):
    """A ``pipe:`` command that exited non-zero (or was killed) after its output was read: the shard's data is bad."""


def _libc_prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _libc_prctl()  # looked up once, here: between fork and exec the child only calls it


def die_with(parent: int, sig: int) -> None:
    """This process gets ``sig`` once ``parent``, the process that started it, ends (Linux): at once if it has."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:  # it ended before the signal was armed
            os._exit(1)


def _in_child(parent: int) -> None:
    """subprocess's ``preexec_fn``: between fork and exec, in the command's process."""
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, ())
    die_with(parent, signal.SIGTERM)


def _status_text(status: int) -> str:
    if status < 0:
        try:
            return f"was killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"was killed by signal {-status}"
    return f"exited with status {status}"


class PipeStream:
    """The output of a ``pipe:`` URL's command, read as a file (``read``; no seek)."""

    def __init__(self, url: str):
        self.command = url[len("pipe:"):]
        self.proc = subprocess.Popen([*_LEADER, self.command], stdout=subprocess.PIPE,
                                     bufsize=0, start_new_session=True,
                                     preexec_fn=functools.partial(_in_child, os.getpid()))
        self.pid, self.owner = self.proc.pid, os.getpid()
        _LIVE.add(self)

    def read(self, n: int = -1) -> bytes:
        return self.proc.stdout.read(n)

    def seekable(self) -> bool:
        return False

    def _exited(self, wait: float) -> Optional[int]:
        """The command's status once it has exited (within ``wait`` seconds), left unreaped; None if it has not."""
        deadline = time.monotonic() + wait
        while True:
            try:
                info = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return None
            if info is not None:
                return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.005)

    def _failed(self, status: Optional[int]) -> Optional[str]:
        return None if status is None or status in _FINE else f"pipe: command {self.command!r} {_status_text(status)}"

    def failure(self) -> Optional[str]:
        """Why the command failed, if it has exited non-zero (within a moment): what to say of output that broke."""
        return self._failed(self._exited(0.1)) if self.pid is not None else None

    def close(self, finished: bool = False) -> None:
        """End the command (see the module docstring); ``finished``: its output was read to the end."""
        if self.pid is None:
            return
        if os.getpid() != self.owner:  # a forked copy (a loader worker's) of another process's stream: not ours to end
            self.pid = None
            self.proc.stdout.close()
            return
        status = None
        try:
            self.proc.stdout.close()  # a command still writing gets SIGPIPE
            status = self._exited(EXIT_GRACE) if finished else None
        finally:  # interrupted too (the in-process timeout's exception): no command is left behind
            pid, self.pid = self.pid, None  # kill_all, from a signal handler, skips it from here on
            _kill_group(pid)  # the leader is unreaped, so its pid (the group's id) cannot have been reused
            self.proc.wait()
            _LIVE.discard(self)
        failed = self._failed(status)
        if failed is not None:
            raise PipeFailed(failed)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def kill_all() -> list:
    """SIGKILL the process group of every ``pipe:`` command this process has open; their pids."""
    pids = [stream.pid for stream in list(_LIVE) if stream.pid is not None and stream.owner == os.getpid()]
    for pid in pids:
        _kill_group(pid)
    return pids


def open_shard(url: str):
    """A readable stream of the shard at ``url``: a ``PipeStream`` for ``pipe:``, else webdataset's gopen."""
    if url.startswith("pipe:"):
        return PipeStream(url)
    return gopen(url)


def close_shard(stream, finished: bool) -> None:
    """Close what ``open_shard`` opened; an error closing a stream not read to its end is no error."""
    if isinstance(stream, PipeStream):
        stream.close(finished)
        return
    try:
        stream.close()
    except Exception:
        # gopen's other pipes (curl, ...) closed early (the epoch ended mid-shard) exit non-zero; that is no error
        if finished:
            raise
