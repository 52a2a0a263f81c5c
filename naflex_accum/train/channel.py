"""The side channel's keys in the job's store, as each client (the main thread's, the watchdog's) reads them.

Invariants: ``failure`` holds the first failure any rank recorded, and a record never replaces it
(compare-and-set); ``hb/R`` is rank R's heartbeat: a count its watchdog raises about every second,
``bye:CODE`` once it leaves, or ``gone`` once rank 0's store process saw rank 0 leave without a goodbye;
``share/N`` is rank 0's result of its N-th solo phase. No call is made once the store's host is seen
gone (``gone``): a call to a dead host prints torch's C++ traceback.
"""
import json
from dataclasses import asdict, dataclass
from typing import Callable, Dict, Iterable, List, Optional

import torch.distributed as dist

FAILURE = "failure"
GONE = "gone"  # rank 0's heartbeat once its store process saw it leave without a goodbye


class StoreGone(dist.DistNetworkError):
    """The store's host is gone (its idle link closed), so the store is not asked: a call to a dead host prints
    torch's C++ traceback."""


@dataclass
class Failure:
    rank: int  # the rank that failed
    code: int  # the exit class every rank ends with
    line: str  # one line, naming the rank
    alive: bool = True  # the failing rank recorded it itself (it is there to hear rank 0's acknowledgement)
    text: str = ""  # a UsageError's own message: ranks that met the same one print it once, bare

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, raw) -> "Failure":
        return cls(**json.loads(raw))

    @property
    def announcer(self) -> int:
        """The rank that prints it: rank 0, unless rank 0 is the rank that is gone."""
        return 1 if self.rank == 0 and not self.alive else 0


class Channel:
    """The side channel in one store client: the first failure, heartbeats (``hb/R``: a count, or ``bye:CODE``
    once the rank leaves) and rank 0's shared results."""

    def __init__(self, store, world_size: int, gone: Callable[[], bool]):
        self._store, self.world_size, self.gone = store, world_size, gone
        self.started: set = set()  # ranks whose heartbeat key exists

    @property
    def store(self):
        if self.gone():
            raise StoreGone("the job's store is gone with its host")
        return self._store

    def record(self, failure: Failure) -> Failure:
        """Record ``failure`` unless one is recorded already; the first one either way."""
        return Failure.decode(self.store.compare_set(FAILURE, "", failure.encode()))

    def first(self) -> Optional[Failure]:
        return Failure.decode(self.store.get(FAILURE)) if self.store.check([FAILURE]) else None

    def beat(self, rank: int, value: str) -> None:
        self.store.set(f"hb/{rank}", value)

    def beat_over(self, rank: int, last: str, value: str) -> str:
        """Rank ``rank``'s heartbeat ``value`` if it still is ``last``; the value it holds now either way."""
        return bytes(self.store.compare_set(f"hb/{rank}", last, value)).decode()

    def beats(self, ranks: Iterable[int]) -> Dict[int, str]:
        """The heartbeats of ``ranks`` that have started (a rank still starting has none yet)."""
        ranks = list(ranks)
        for r in ranks:
            if r not in self.started and self.store.check([f"hb/{r}"]):
                self.started.add(r)
        have = [r for r in ranks if r in self.started]
        values = self.store.multi_get([f"hb/{r}" for r in have]) if have else []
        return {r: bytes(v).decode() for r, v in zip(have, values)}


class Pulse:
    """When each rank's heartbeat last moved, by this process's clock (clocks of other hosts never compared)."""

    def __init__(self):
        self.seen: Dict[int, tuple] = {}

    def update(self, beats: Dict[int, str], now: float) -> None:
        for rank, value in beats.items():
            old = self.seen.get(rank)
            if old is None or old[0] != value:
                self.seen[rank] = (value, now)

    def reset(self, now: float) -> None:
        """This process was stopped itself (the whole job suspended): what it missed is no peer's silence."""
        self.seen = {rank: (value, now) for rank, (value, _) in self.seen.items()}

    def quiet(self, now: float, longer_than: float) -> List[int]:
        """Ranks still in the run whose heartbeat has not moved for more than ``longer_than`` seconds."""
        return sorted(r for r, (value, since) in self.seen.items()
                      if not value.startswith("bye") and now - since > longer_than)

    def said_bye(self, rank: int) -> Optional[str]:
        value = self.seen.get(rank, ("",))[0]
        return value[4:] if value.startswith("bye:") else None
