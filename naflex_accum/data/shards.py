"""Shard URLs: expanding ``--train-data``, validating it, and the order each reader visits shards in.

Invariant: ``expand_urls`` either returns a non-empty list of shard URLs whose
local files all exist, or raises a one-line ``UsageError`` naming the flag and
the pattern or file at fault. Both shard streams are endless, seeded, and depend
only on ``(seed, epoch, slot)`` (one slot per rank and worker), so every rank
computes its own stream the same way whatever the others do:
``shard_order`` (open_clip without ``--dataset-resampled``) passes over the shard
list without replacement, each pass reshuffled and split between the slots, and
a slot that has fewer shards than it needs goes on to the next pass, so no rank
or worker ever runs dry; ``shard_sampler`` (``--dataset-resampled``) draws shards
with replacement, each with its source's weight (``--train-data-upsampling-factors``).
"""
import glob
import itertools
import json
import math
import os
import random
from typing import Iterator, List, Optional, Sequence, Union
from urllib.parse import urlparse
from urllib.request import url2pathname

from ..errors import UsageError
from .schedule import derive_seed

_GLOB_CHARS = set("*?[")


def local_path(url: str) -> Optional[str]:
    """The file path of a local shard URL (plain path or ``file:``), None for pipe:/remote URLs."""
    scheme = urlparse(url).scheme
    if scheme == "":
        return url
    if scheme == "file":
        return url2pathname(urlparse(url).path)
    return None


def _expand_local(pattern: str, source: str, flag: str) -> List[str]:
    if _GLOB_CHARS & set(pattern):
        found = sorted(glob.glob(pattern))
        if not found:
            raise UsageError(f"{flag}: pattern {pattern!r} matches no files")
        return found
    if os.path.isdir(pattern):
        found = sorted(glob.glob(os.path.join(pattern, "*.tar")))
        if not found:
            raise UsageError(f"{flag}: directory {pattern!r} holds no .tar shards")
        return found
    return [pattern]


def expand_urls(spec: str, flag: str = "--train-data") -> List[str]:
    """``'a/{000..009}.tar::pipe:cat b.tar'`` -> the list of shard URLs, checked as far as is cheap.

    Sources are joined by ``::`` (as in open_clip); each is braceexpanded; local ones
    may also be globs or a directory of ``.tar`` files. ``pipe:`` and remote URLs are
    passed through unchecked (a bad one is reported as a corrupt shard when read).
    """
    return [url for source in expand_sources(spec, flag) for url in source]


def expand_sources(spec: str, flag: str = "--train-data") -> List[List[str]]:
    """``expand_urls``, one list per ``::``-joined source."""
    from braceexpand import braceexpand

    if not isinstance(spec, str) or not spec.strip():
        raise UsageError(f"{flag} is empty; give webdataset shards, e.g. /data/shard-{{000000..000099}}.tar "
                         f"(several sources joined by '::')")
    sources = []
    for source in spec.split("::"):
        source = source.strip()
        if not source:
            raise UsageError(f"{flag} {spec!r} has an empty source (a leading, trailing or doubled '::')")
        expanded = list(braceexpand(source))
        if local_path(expanded[0]) is None:
            sources.append(expanded)
            continue
        paths = [p for item in expanded for p in _expand_local(local_path(item), source, flag)]
        missing = [p for p in paths if not os.path.isfile(p)]
        if missing:
            raise UsageError(f"{flag}: shard file {missing[0]!r} does not exist ({len(missing)} of {len(paths)} "
                             f"shards of {source!r} missing)")
        sources.append(paths)
    return sources


def shard_weights(sources: Sequence[Sequence[str]], factors: Union[None, str, Sequence[float]],
                  resampled: bool) -> Optional[List[float]]:
    """One sampling weight per shard: its source's upsampling factor (open_clip's meaning); None without factors."""
    if factors is None:
        return None
    flag = "--train-data-upsampling-factors"
    if not resampled:
        raise UsageError(f"{flag} needs --dataset-resampled: the factors weight shards drawn with replacement")
    values = factors.split("::") if isinstance(factors, str) else list(factors)
    if len(values) != len(sources):
        raise UsageError(f"{flag} has {len(values)} values but --train-data has {len(sources)} source(s) joined "
                         f"by '::'; give one factor per source")
    try:
        values = [float(v) for v in values]
    except (TypeError, ValueError):
        raise UsageError(f"{flag} {factors!r}: each factor must be a number") from None
    if any(not math.isfinite(v) or v < 0 for v in values) or not any(v > 0 for v in values):
        raise UsageError(f"{flag} {values}: factors must be finite, >= 0, and not all 0")
    return [v for v, source in zip(values, sources) for _ in source]


def dataset_size(urls: Sequence[str]) -> Optional[int]:
    """Samples in ``urls`` from open_clip's ``sizes.json`` (``{shard file name: count}`` beside the shards).

    None unless every shard is local and listed: sizing an epoch must not need a read of the data.
    """
    cache, total = {}, 0
    for url in urls:
        path = local_path(url)
        if path is None:
            return None
        folder = os.path.dirname(os.path.abspath(path))
        if folder not in cache:
            try:
                with open(os.path.join(folder, "sizes.json")) as f:
                    cache[folder] = json.load(f)
            except (OSError, ValueError):
                cache[folder] = {}
        count = cache[folder].get(os.path.basename(path)) if isinstance(cache[folder], dict) else None
        if not isinstance(count, int) or count < 0:
            return None
        total += count
    return total


def shard_order(urls: Sequence[str], seed: int, epoch: int, slot: int, num_slots: int) -> Iterator[str]:
    """Endless stream of the shards slot ``slot`` of ``num_slots`` reads in an epoch.

    Pass p shuffles the whole list with a seed of (seed, epoch, p), the same for every
    slot, and slot s takes every num_slots-th shard from position s; with fewer
    shards than slots it takes the one at s mod len(urls), a different one each pass.
    """
    urls = list(urls)
    passes = 0
    while True:
        order = urls[:]
        random.Random(derive_seed("shards", seed, epoch, passes)).shuffle(order)
        yield from order[slot::num_slots] or [order[slot % len(order)]]
        passes += 1


def shard_sampler(urls: Sequence[str], weights: Optional[Sequence[float]], seed: int, epoch: int,
                  slot: int) -> Iterator[str]:
    """Endless stream of shards drawn with replacement for slot ``slot``, each in proportion to its weight."""
    rng = random.Random(derive_seed("resampled", seed, epoch, slot))
    urls = list(urls)
    cumulative = list(itertools.accumulate(weights)) if weights is not None else None
    while True:
        yield from rng.choices(urls, cum_weights=cumulative, k=64)
