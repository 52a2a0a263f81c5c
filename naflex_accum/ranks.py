"""Which process this is: the rank variables of every launcher, in open_clip's precedence, and a SLURM job's
head node and port (torch-free: the launch scripts ask it before anything loads).

Invariant: the one list of launcher variables the package reads (torchrun, MPI/PMI, SLURM, Open MPI; the first
found wins, as open_clip's ``world_info_from_env``), so the trainer's world (``train.ending.distributed``) and the
runner's rank-0-only messages (``upstream.patch``) never disagree on who rank 0 is.
"""
import os
import re

LOCAL_RANK_VARS = ("LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK")
RANK_VARS = ("RANK", "PMI_RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK")
WORLD_VARS = ("WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")


def first_var(names, env=None):
    """The first of ``names`` set in ``env`` (``os.environ``) and its value, as the launchers' precedence has it;
    (None, None) when none is."""
    env = os.environ if env is None else env
    return next(((name, env[name]) for name in names if name in env), (None, None))


def process_rank() -> int:
    """This process's global rank: torch.distributed's once initialised, else the launcher's variable, else 0."""
    import torch.distributed as dist  # torch only when asked: the runner reads this before importing upstream

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return launched_int(RANK_VARS, 0)


def launched_int(names, default: int) -> int:
    """The first of ``names`` set, as an integer (``int()``, as the trainer reads it); ``default`` when none is set or
    it is not one (the trainer refuses it in one line naming the variable)."""
    try:
        return int(first_var(names)[1])
    except (TypeError, ValueError):
        return default


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
