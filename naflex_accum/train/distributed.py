"""Process-group set-up from torchrun's or SLURM's environment, with open_clip's precedence.

Invariants: every rank agrees on (rank, world_size) before any model or data is
made; a half-set environment (a RANK without a WORLD_SIZE, say) is an error,
not a silent single-process run; collectives here are no-ops in one process.
"""
import os
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import UsageError
from ..ranks import LOCAL_RANK_VARS, RANK_VARS, WORLD_VARS

# The first variable found wins, as open_clip's world_info_from_env; not that function itself, because it
# turns a half-set environment into a silent single-process run, which is refused here.


@dataclass
class World:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    distributed: bool = False

    @property
    def is_master(self) -> bool:
        return self.rank == 0

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


def _collective_device():
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _first(env, names):
    for name in names:
        if name in env:
            return name, env[name]
    return None, None


def _int_var(name, value):
    try:
        return int(value)
    except ValueError:
        raise UsageError(f"environment variable {name}={value!r} is not an integer") from None


def world_from_env(env=None) -> World:
    env = os.environ if env is None else env
    rank_name, rank = _first(env, RANK_VARS)
    world_name, world = _first(env, WORLD_VARS)
    local_name, local = _first(env, LOCAL_RANK_VARS)
    if (rank is None) != (world is None):
        have, missing = (rank_name, "a world size (WORLD_SIZE or SLURM_NTASKS)") if rank is not None \
            else (world_name, "a rank (RANK or SLURM_PROCID)")
        raise UsageError(f"{have} is set but {missing} is not: launch with torchrun or srun, or unset {have}")
    if rank is None:
        return World()
    rank, world = _int_var(rank_name, rank), _int_var(world_name, world)
    local = _int_var(local_name, local) if local is not None else 0
    if world < 1 or not 0 <= rank < world:
        raise UsageError(f"{rank_name}={rank} is not in [0, {world_name}={world})")
    return World(rank=rank, local_rank=local, world_size=world, distributed=world > 1)


def slurm_master_addr(nodelist: str) -> str:
    """The first host of a SLURM node list like ``node[01-04,07],gpu5``."""
    first = re.split(r",(?![^\[]*\])", nodelist.strip())[0]
    m = re.match(r"^([^\[]+)\[([^\]]+)\]", first)
    if not m:
        return first
    prefix, ranges = m.groups()
    return prefix + ranges.split(",")[0].split("-")[0]


def slurm_master_port(job_id: str) -> int:
    return 10000 + int(re.sub(r"\D", "", job_id) or 0) % 20000


def resolve_device(device_arg, world) -> torch.device:
    """The device this rank trains on: ``--device`` (cpu, cuda, cuda:N), else a GPU if there is one.

    A device that is not there is a ``UsageError`` naming ``--device`` and what there is, before any
    CUDA call that would fail deep inside torch.
    """
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


def init_distributed(device_arg=None, env=None) -> tuple:
    """``(World, torch.device)``; initialises the process group when there is more than one rank."""
    env = os.environ if env is None else env
    world = world_from_env(env)
    device = resolve_device(device_arg, world)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world.distributed and not dist.is_initialized():
        if "MASTER_ADDR" not in env and "SLURM_JOB_NODELIST" in env:
            os.environ["MASTER_ADDR"] = slurm_master_addr(env["SLURM_JOB_NODELIST"])
        if "MASTER_PORT" not in env and "SLURM_JOB_ID" in env:
            os.environ["MASTER_PORT"] = str(slurm_master_port(env["SLURM_JOB_ID"]))
        for var in ("MASTER_ADDR", "MASTER_PORT"):
            if var not in os.environ:
                raise UsageError(f"{var} is not set: launch with torchrun, or under SLURM with SLURM_JOB_NODELIST")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method="env://",
                                rank=world.rank, world_size=world.world_size)
    return world, device
