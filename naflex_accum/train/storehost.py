"""Rank 0's store process: the job's store in a process of its own, so that it outlives rank 0.

Without torchrun (srun starts the ranks), env:// has rank 0 host the job's ``TCPStore``; a rank 0
killed or frozen would then take the store with it, and with it every other rank's way to hear
what happened. Here rank 0 forks, before anything else starts (no thread, no CUDA context, no
loader), a process that serves the store at MASTER_ADDR:MASTER_PORT, as torchrun's agent serves its
own. Invariants: the process serves the store and nothing else; it ignores the signals a scheduler
sends the whole job (the ranks decide when the run ends); it ends once rank 0 is gone (the lifeline
pipe it alone holds the read end of closes) and every rank has said goodbye in the store, or
``GRACE`` seconds after rank 0 is gone, whichever comes first; a rank 0 gone without a goodbye has
its heartbeat set to ``GONE`` at once, which the others take as its death (they may be waiting on
the store for its result, where no collective breaks to tell them); it never runs the trainer's
exit handlers (``os._exit``).
"""
import os
import select
import signal
import time
from datetime import timedelta

import torch.distributed as dist

from ..errors import UsageError
from .channel import GONE

GRACE = 60.0  # seconds the store outlives rank 0 for the others to read the failure and say goodbye
LIFELINES: list = []  # rank 0's write end of the lifeline: a child rank 0 forks must close it (peers)


def start(address: tuple, world_size: int, timeout: timedelta, prefix: str) -> int:
    """Fork the store's process and wait until it serves; its pid. A port that cannot be served is a
    ``UsageError`` naming MASTER_ADDR and MASTER_PORT."""
    ready_r, ready_w = os.pipe()
    life_r, life_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the store's process: whatever happens, none of the trainer's code runs here
        code = 1
        try:
            os.close(ready_r)
            os.close(life_w)
            _serve(address, world_size, timeout, prefix, ready_w, life_r)
            code = 0
        except BaseException as exc:  # one line for rank 0 to raise, while it still waits for one
            why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            try:
                os.write(ready_w, f"{why}\n".encode(errors="replace"))
            except OSError:  # it no longer waits: it was told "ok" before
                pass
        finally:
            os._exit(code)
    os.close(ready_w)
    os.close(life_r)
    reply = b""
    while not reply.endswith(b"\n"):
        chunk = os.read(ready_r, 4096)
        if not chunk:
            break
        reply += chunk
    os.close(ready_r)
    if reply != b"ok\n":
        os.waitpid(pid, 0)
        os.close(life_w)
        why = reply.decode(errors="replace").strip() or "its process ended at once"
        raise UsageError(f"rank 0: cannot serve the job's store at {address[0]}:{address[1]} (MASTER_ADDR, "
                         f"MASTER_PORT): {why}")
    LIFELINES.append(life_w)  # open until rank 0's process ends, however it ends
    return pid


def _serve(address: tuple, world_size: int, timeout: timedelta, prefix: str, ready_w: int, life_r: int) -> None:
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    store = dist.TCPStore(address[0], address[1], world_size, is_master=True, timeout=timeout, multi_tenant=True,
                          wait_for_workers=False)
    os.write(ready_w, b"ok\n")
    os.close(ready_w)
    select.select([life_r], [], [])  # returns when rank 0's process is gone: its end of the pipe closed
    channel, deadline = dist.PrefixStore(prefix, store), time.monotonic() + GRACE
    last = bytes(channel.get("hb/0")) if channel.check(["hb/0"]) else b""
    if not last.startswith(b"bye"):  # gone without a goodbye: tell the others at once (channel.GONE)
        channel.compare_set("hb/0", last.decode(), GONE)
    keys = [f"hb/{rank}" for rank in range(world_size)]
    while time.monotonic() < deadline:
        if channel.check(keys) and all(bytes(v).startswith(b"bye") or bytes(v) == GONE.encode()
                                       for v in channel.multi_get(keys)):
            return
        time.sleep(0.2)
