"""Process-group set-up from torchrun's or SLURM's environment, with open_clip's precedence.

Invariants: every rank agrees on (rank, world_size) before anything is made; a half-set environment is an
error, not a silent single-process run; collectives here are no-ops in one process. Ranks are heard through
the job's store (``liveness``); a collective waits ``LONG_TIMEOUT`` until the first optimizer step has ended
and while rank 0 works alone, --dist-timeout otherwise. docs/distributed.md.
"""
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from ...errors import UsageError, first_line, record_exit
from ...ranks import LOCAL_RANK_VARS, RANK_VARS, WORLD_VARS, first_var, slurm_master_addr, slurm_master_port
from .exits import EXIT_LOADER
from .liveness import Liveness

DEFAULT_TIMEOUT = 600.0  # --dist-timeout's default (docs/distributed.md says why)
LONG_TIMEOUT = 7200.0  # start-up to the first step's end, and rank 0's solo phases (or --dist-timeout, if longer)

# NCCL: a timed-out collective ends the process, and the flight recorder dumps every rank's last collectives;
# each is set unless the user set it (under either of its names).
NCCL_DEFAULTS = {("TORCH_NCCL_ASYNC_ERROR_HANDLING",): "3", ("TORCH_NCCL_DUMP_ON_TIMEOUT",): "1",
                 ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"): "2000"}

# The first variable found wins, as open_clip's world_info_from_env (which takes a half-set environment for one process)


@dataclass
class World:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    distributed: bool = False
    store: Optional[dist.Store] = None  # the job's store, in a run of several processes
    peers: Optional[Liveness] = None  # how this rank is heard, in a run of several processes
    timeout: float = DEFAULT_TIMEOUT  # --dist-timeout
    started: bool = False  # the first optimizer step has ended: collectives wait --dist-timeout from here on

    @property
    def is_master(self) -> bool:
        return self.rank == 0

    def master_result(self, obj):
        """Rank 0's ``obj`` on every rank, after rank 0 worked alone (evaluating, writing a checkpoint): the
        others wait up to ``LONG_TIMEOUT`` for it; rank 0, which comes last, as long as for any collective."""
        if not self.distributed or self.is_master:
            return self.broadcast_object(obj)
        dist.set_timeout(world_timeout(self.timeout))
        try:
            return self.broadcast_object(obj)
        finally:
            self.first_step_done(self.started)

    def first_step_done(self, done: bool = True) -> None:
        """From the end of the first optimizer step on, a collective waits at most --dist-timeout."""
        self.started = done
        if self.distributed and dist.is_initialized():
            dist.set_timeout(timedelta(seconds=self.timeout) if done else world_timeout(self.timeout))

    def close(self, code=0) -> None:
        """This rank's end: the listener stops (rank 0 serving the store waits for the others), then the group."""
        if self.peers is not None:
            self.peers.close(ok=code is not None)
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()

    def gather_object(self, obj) -> list:
        """Every rank's ``obj``, in rank order (on every rank)."""
        if not self.distributed:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj):
        """Rank 0's ``obj`` on every rank (``obj`` itself in one process)."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, device=_collective_device())
        return box[0]

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """In-place all-reduce sum of one (packed) tensor; one collective, no host sync."""
        if self.distributed:
            dist.all_reduce(tensor)
        return tensor

    def min_int(self, value: int) -> int:
        if not self.distributed:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=_collective_device())
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def all_equal(self, values) -> bool:
        """Whether a small list of ints is the same on every rank (one all-reduce of max and -min)."""
        if not self.distributed:
            return True
        t = torch.tensor(list(values), dtype=torch.int64, device=_collective_device())
        both = torch.cat([t, -t])
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        return bool(torch.equal(both[: len(t)], -both[len(t):]))


def world_timeout(timeout: float) -> timedelta:
    """The process group's timeout until the first step has ended, and while rank 0 works alone."""
    return timedelta(seconds=max(LONG_TIMEOUT, timeout))


def _collective_device():
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _int_var(name, value):
    try:
        return int(value)
    except ValueError:
        raise UsageError(f"environment variable {name}={value!r} is not an integer") from None


def world_from_env(env=None) -> World:
    rank_name, rank = first_var(RANK_VARS, env)
    world_name, world = first_var(WORLD_VARS, env)
    local_name, local = first_var(LOCAL_RANK_VARS, env)
    if (rank is None) != (world is None):
        have, missing = (rank_name, f"a world size ({WORLD_VARS[RANK_VARS.index(rank_name)]})") if rank is not None \
            else (world_name, f"a rank ({RANK_VARS[WORLD_VARS.index(world_name)]})")  # its launcher's own pair
        raise UsageError(f"{have} is set but {missing} is not: launch with torchrun or srun, or unset {have}")
    if rank is None:
        return World()
    rank, world = _int_var(rank_name, rank), _int_var(world_name, world)
    local = _int_var(local_name, local) if local is not None else 0
    if world < 1:
        raise UsageError(f"{world_name}={world}: a world size is 1 or more")
    if not 0 <= rank < world:
        raise UsageError(f"{rank_name}={rank} is not in [0, {world_name}={world})")
    if local < 0:  # cuda:-3 would fail deep inside torch
        raise UsageError(f"{local_name}={local} is negative: a local rank is 0 or more")
    return World(rank=rank, local_rank=local, world_size=world, distributed=world > 1)


def resolve_device(device_arg, world) -> torch.device:
    """``--device`` (cpu, cuda, cuda:N), else a GPU if there is one; one that is not there is a ``UsageError``
    naming what there is, before a CUDA call would fail deep inside torch."""
    if not device_arg:
        device_arg = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(device_arg)
    except RuntimeError:
        raise UsageError(f"--device {device_arg!r} is not a device; valid: cpu, cuda, cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {device_arg}: the trainer runs on cpu or cuda (cuda:N)")
    if device.type == "cpu":
        return device
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        shown = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        raise UsageError(f"--device {device_arg}: no CUDA GPU is visible to this process{shown}; use --device cpu, "
                         f"or leave --device out to use a GPU when there is one")
    index = world.local_rank if device.index is None else device.index
    if index >= count:
        which = f"cuda:{index}" if device.index is not None else f"local rank {index}'s cuda:{index}"
        raise UsageError(f"--device {device_arg}: {which} is past the last GPU; this machine shows {count} "
                         f"(cuda:0 to cuda:{count - 1})")
    return torch.device("cuda", index)


def _master_address(env) -> tuple:
    """MASTER_ADDR and MASTER_PORT, from SLURM's node list and job id when they are unset."""
    if "MASTER_ADDR" not in env and "SLURM_JOB_NODELIST" in env:
        os.environ["MASTER_ADDR"] = slurm_master_addr(env["SLURM_JOB_NODELIST"])
    if "MASTER_PORT" not in env and "SLURM_JOB_ID" in env:
        os.environ["MASTER_PORT"] = str(slurm_master_port(env["SLURM_JOB_ID"]))
    for var in ("MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            raise UsageError(f"{var} is not set: launch with torchrun, or under SLURM with SLURM_JOB_NODELIST")
    port = os.environ["MASTER_PORT"]
    if not port.isdigit() or not 0 <= int(port) < 2 ** 16:
        raise UsageError(f"MASTER_PORT={port!r} is not a port number (0 to 65535)")
    return os.environ["MASTER_ADDR"], int(port)


def _open_store(world: World, address: tuple, timeout: timedelta):
    """The job's store where env:// has it: torchrun's agent's at MASTER_ADDR:MASTER_PORT, else rank 0's."""
    host, port = address
    serves = world.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True)
    try:
        return dist.TCPStore(host, port, world.world_size, is_master=serves, timeout=timeout)
    except (RuntimeError, ValueError) as exc:  # DistNetworkError, DistStoreError: one line, not torch's report
        raise UsageError(f"rank {world.rank}: cannot reach the job's store at {host}:{port} (MASTER_ADDR, "
                         f"MASTER_PORT): {first_line(exc)}") from None


def connect(env=None, timeout: float = DEFAULT_TIMEOUT, prog: str = "naflex-accum train",
            ends_process: bool = False) -> World:
    """This process's ``World``; with several processes this rank is heard (``World.peers``) from here on,
    before any other step of the set-up can fail. ``ends_process``: see ``preempt.StopRequest``."""
    env = os.environ if env is None else env
    world = world_from_env(env)
    if world.distributed:
        address = _master_address(env)
        world.store, world.timeout = _open_store(world, address, world_timeout(timeout)), timeout
        world.peers = Liveness(world, address, timeout, prog, ends_process)
    return world


def init_distributed(device_arg=None, env=None, world: Optional[World] = None) -> tuple:
    """``(World, torch.device)``; the process group on ``world``'s store when there are several ranks."""
    world = connect(env) if world is None else world
    device = resolve_device(device_arg, world)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world.distributed and not dist.is_initialized():
        for names, value in NCCL_DEFAULTS.items() if device.type == "cuda" else ():  # as torchtitan
            if not any(name in os.environ for name in names):
                os.environ[names[0]] = value
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                store=dist.PrefixStore("default_pg", world.store), rank=world.rank,
                                world_size=world.world_size, timeout=world_timeout(world.timeout))
        # What the job's script reads if this process ends without a word (killed, or NCCL's watchdog after
        # --dist-timeout): requeue. The class the process ends with replaces it.
        record_exit(EXIT_LOADER, f"rank {world.rank} ended without a word: killed, or ended by NCCL's watchdog "
                                 "after --dist-timeout (its output says which)")
    return world, device
