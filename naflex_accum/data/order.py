"""Where an epoch's batches fall in its global sample order, and which rank and worker reads which part.

Invariant: an epoch's positions depend only on the data set, the seed, the epoch and ``--data-slots``; every
run of an epoch consumes a prefix with no gap or repeat (global batch ``j`` takes the next ``W * b_j``, rank
``r`` those congruent to ``base + r`` mod ``W``), a slot's positions in a pass fall to one rank and one of its
workers (``slot_worker``). A resume at another world size is a new ``Segment``. docs/data.md, "What an epoch is".
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
    """Epoch ``epoch`` from global position ``base`` on, ``num_batches`` batches per rank at ``world_size``; after
    ``first_step`` optimizer steps worth ``progress`` of the epoch's LR schedule and ``base_tokens`` token slots."""
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
    """The loader worker (of ``workers``) that reads ``slot``: a slot's positions in a pass are congruent modulo
    the world size, so fall to one rank, whose slots ``r, r + W, ...`` its workers take in turn."""
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
