"""Where an epoch's batches fall in its global sample order, and which rank and worker reads which part.

Invariant: an epoch's samples form one global sequence of positions that depends
only on the data set, the seed, the epoch and the number of data slots ``C``
(``--data-slots``), never on the world size or the number of loader workers (what
each position holds is ``slots``'s). Every run of an epoch consumes a prefix of
that sequence with no gap and no repeat: global batch ``j`` of a segment that
starts at position ``base`` takes the next ``W * b_j`` positions, and rank ``r`` of
``W`` takes those congruent to ``base + r`` modulo ``W``, in order. A slot's
positions in one pass all fall to one rank (``W`` divides ``C``), read by one of
its loader workers (``slot_worker``). An epoch is run in segments: the first at
the epoch's start; a resume at another world size starts a new one where the
saved one stopped (``base`` = the global samples already consumed), with a batch
schedule of its own for the samples (or tokens) the epoch still has to cover.
"""
import math
from dataclasses import asdict, dataclass
from typing import Dict, List, Sequence

from ..errors import UsageError, check_int


def default_slots(world_size: int, workers: int) -> int:
    """One slot per (rank, worker) of the run's first start: the reading pattern open_clip users know."""
    return world_size * max(1, workers)


def check_slots(slots: int, world_size: int, where: str = "--data-slots") -> int:
    check_int(slots, where)
    if slots % world_size:
        raise UsageError(f"{where} {slots} is not a multiple of the world size {world_size}: every rank reads "
                         f"{slots} / world size slots; use a multiple of every world size the run may have "
                         f"(e.g. {math.lcm(slots, world_size)}), or resume from an epoch_K.pt checkpoint")
    return slots


@dataclass(frozen=True)
class Segment:
    """Epoch ``epoch`` from global position ``base`` on, ``num_batches`` batches per rank at ``world_size``.

    ``first_step`` optimizer steps of the epoch came before it, ``progress`` is the fraction of
    the epoch they count for in the learning-rate schedule (0 for an epoch's first segment),
    ``base_tokens`` the global token slots (batch size x sequence length) consumed before it.
    """
    epoch: int
    num_batches: int
    world_size: int
    slots: int
    base: int = 0
    first_step: int = 0
    progress: float = 0.0
    base_tokens: int = 0

    def to_dict(self) -> Dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: Dict) -> "Segment":
        return cls(**{key: values[key] for key in cls.__dataclass_fields__})


def slot_worker(slot: int, world_size: int, workers: int) -> int:
    """The loader worker (of ``workers``) that reads ``slot`` on the rank its positions fall to.

    A slot's positions of one pass are congruent modulo the slot count, so modulo the world
    size (which divides it): they all fall to one rank, and the rank's slots are ``r, r + W,
    r + 2W, ...``; its workers take every ``workers``-th of them.
    """
    return (slot // world_size) % max(1, workers)


def batch_positions(segment: Segment, rank: int, cursor: int, batch_size: int) -> range:
    """The global positions of rank ``rank``'s batch whose first sample is the rank's ``cursor``-th of the segment."""
    world = segment.world_size
    start = segment.base + rank + world * cursor
    return range(start, start + world * batch_size, world)


def cursors(batch_sizes: Sequence[int]) -> List[int]:
    """Each batch's first rank-local sample index: the running sum of the batch sizes before it."""
    out, total = [], 0
    for size in batch_sizes:
        out.append(total)
        total += size
    return out
