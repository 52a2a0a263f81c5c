"""Shard URLs: expanding ``--train-data`` (and ``--val-data``), validating it, and each shard's sampling weight.

Invariant: ``expand_urls`` either returns a non-empty list of shard URLs whose
local files all exist, or raises a one-line ``UsageError`` naming the flag and
the pattern or file at fault; ``shard_weights`` gives every shard its source's
``--train-data-upsampling-factors`` value, or refuses the factors in one line.
"""
import glob
import math
import os
from typing import List, Optional, Sequence, Union
from urllib.parse import urlparse
from urllib.request import url2pathname

from braceexpand import braceexpand

from ..errors import UsageError

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
    """``'a/{000..009}.tar::pipe:cat b.tar'`` -> the shard URLs: ``::``-joined sources, braceexpanded, local ones
    also globs or a folder of ``.tar`` files, checked; ``pipe:`` and remote URLs pass unchecked."""
    return [url for source in expand_sources(spec, flag) for url in source]


def expand_sources(spec: str, flag: str = "--train-data") -> List[List[str]]:
    """``expand_urls``, one list per ``::``-joined source."""
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


def upsampling_factors(factors: Union[None, str, Sequence[float]], sources: int,
                       resampled: bool) -> Optional[List[float]]:
    """``--train-data-upsampling-factors`` (``'1::2'`` or numbers) as one float per '::' source of ``sources``;
    None without factors; else the one-line refusal."""
    if factors is None:
        return None
    flag = "--train-data-upsampling-factors"
    if not resampled:
        raise UsageError(f"{flag} needs --dataset-resampled (sampling shards with replacement), as in open_clip")
    try:
        values = [float(v) for v in (factors.split("::") if isinstance(factors, str) else factors)]
    except (TypeError, ValueError):
        raise UsageError(f"{flag} {factors!r}: give numbers joined by '::', e.g. 1::2::0.5") from None
    if len(values) != sources:
        raise UsageError(f"{flag} {factors!r} has {len(values)} factors but --train-data has {sources} '::'-joined "
                         f"sources; give one factor per source")
    if any(not math.isfinite(v) or v < 0 for v in values) or sum(values) <= 0:
        raise UsageError(f"{flag} {factors!r}: factors must be finite, >= 0, and not all 0")
    return values


def shard_weights(sources: Sequence[Sequence[str]], factors: Union[None, str, Sequence[float]],
                  resampled: bool) -> Optional[List[float]]:
    """One sampling weight per shard: its source's upsampling factor (open_clip's meaning); None without factors."""
    values = upsampling_factors(factors, len(sources), resampled)
    return None if values is None else [v for v, source in zip(values, sources) for _ in source]
