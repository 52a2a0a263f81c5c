"""How many samples each training shard holds: the numbers every slot's share of an epoch is cut from.

Invariant: ``shard_sizes`` gives one count per URL, the same in every process, from open_clip's ``sizes.json``
where it lists a folder's every shard, else from a header count cached in ``cache_dir()`` while the file (or
URL) is unchanged. A cache that cannot be written costs a count, never the run; an unreadable shard raises
``samples.ShardReadError``. docs/data.md, "What an epoch is".
"""
import hashlib
import json
import logging
import os
import tempfile
import time
from typing import Dict, List, Optional, Sequence, Tuple

from ..errors import TransientError, UsageError
from .samples import count_samples, shard_error
from .shards import local_path

log = logging.getLogger(__name__)
SIZES_FILE = "sizes.json"


def cache_dir() -> str:
    """``$NAFLEX_ACCUM_CACHE``, else ``$XDG_CACHE_HOME/naflex-accum``, else ``~/.cache/naflex-accum``."""
    explicit = os.environ.get("NAFLEX_ACCUM_CACHE")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "naflex-accum")


def same_file(url: str):
    """What identifies a shard whatever its spelling: a local file's device and inode (a symlink, ``./`` or
    ``file:`` name the same), else the URL itself."""
    path = local_path(url)
    if path is None:
        return url
    try:
        info = os.stat(path)
    except OSError:
        return os.path.realpath(path)
    return info.st_dev, info.st_ino


def canonical(url: str) -> str:
    """A shard's name in a checkpoint's shard list: a local file's real path, else the URL."""
    path = local_path(url)
    return url if path is None else os.path.realpath(path)


def _listed(urls: Sequence[str]) -> Dict[str, int]:
    """``{url: count}`` of the local shards their folder's ``sizes.json`` lists; a bad count is one line."""
    folders: Dict[str, dict] = {}
    out = {}
    for url in urls:
        path = local_path(url)
        if path is None:
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if folder not in folders:
            try:
                with open(os.path.join(folder, SIZES_FILE)) as f:
                    listing = json.load(f)
            except (OSError, ValueError):
                listing = {}
            folders[folder] = listing if isinstance(listing, dict) else {}
        count = folders[folder].get(os.path.basename(path))
        if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
            most = os.path.getsize(path) // 512  # every sample's first member costs a 512-byte tar header
            if count > most:
                raise UsageError(f"{os.path.join(folder, SIZES_FILE)} lists {count} samples for "
                                 f"{os.path.basename(path)}, more than its {os.path.getsize(path)} bytes can hold "
                                 f"(at most {most}); correct or delete that entry (the shard is then counted)")
            out[url] = count
    return out


def listed_total(urls: Sequence[str]) -> Optional[int]:
    """Samples in ``urls`` by their folders' ``sizes.json``; None unless it lists every one (a local shard)."""
    listed = _listed(urls)
    return sum(listed.values()) if len(listed) == len(urls) else None


def _stamp(url: str) -> Optional[Tuple[int, int]]:
    path = local_path(url)
    if path is None:
        return None
    try:
        info = os.stat(path)
    except OSError as exc:  # there a moment ago (expand_urls checked it): its storage failed
        raise shard_error(url, exc) from None
    return info.st_size, info.st_mtime_ns


def _cache_file(urls: Sequence[str]) -> str:
    digest = hashlib.sha256("\n".join(urls).encode("utf-8", "surrogateescape")).hexdigest()[:24]
    return os.path.join(cache_dir(), f"sizes-{digest}.json")


def _read_cache(path: str) -> Dict[str, list]:
    try:
        with open(path) as f:
            cached = json.load(f)
        return cached if isinstance(cached, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(path: str, entries: Dict[str, list]) -> bool:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".sizes-")
        with os.fdopen(fd, "w") as f:
            json.dump(entries, f)
        os.replace(tmp, path)  # several processes may count at once: each writes whole, the last one stays
        return True
    except OSError as exc:
        log.warning(f"cannot cache shard sizes in {path} ({exc}); set NAFLEX_ACCUM_CACHE to a writable folder "
                    f"to count them once")
        return False


def shard_sizes(urls: Sequence[str], flag: str = "--train-data") -> List[int]:
    """Samples in each shard of ``urls`` (see the module docstring); a shard that cannot be read to its end
    counts the samples before the damage, with a warning."""
    listed = _listed(urls)
    missing = [url for url in urls if url not in listed]
    if not missing:
        return [listed[url] for url in urls]
    path = _cache_file(missing)
    cached, counted, started = _read_cache(path), {}, time.perf_counter()
    for url in missing:
        stamp = _stamp(url)
        stamp = list(stamp) if stamp else None
        entry = cached.get(url)
        if isinstance(entry, list) and len(entry) == 2 and entry[0] == stamp and isinstance(entry[1], int):
            continue
        count, problem = count_samples(url)
        if problem is not None and stamp is None:
            # a pipe: or remote source that failed may work at the next start: no epoch is cut from a guess
            raise TransientError(f"{flag}: cannot count the samples of {url!r} ({problem}); run again once it "
                                 f"reads, or list it in a {SIZES_FILE}")
        counted[url] = count
        if problem is None:
            cached[url] = [stamp, count]
        else:  # a local file damaged part-way: its samples before the damage, not cached (it may be replaced)
            log.warning(f"{flag}: shard {url} cannot be read past its sample {count} ({problem}); its "
                        f"{count} samples before that are used")
    if counted:
        kept = _write_cache(path, {url: cached[url] for url in missing if url in cached})
        log.info(f"{flag}: counted the samples of {len(counted)} shard(s) without a {SIZES_FILE} in "
                 f"{time.perf_counter() - started:.1f} s" + (f"; kept in {path} for the next start" if kept else ""))
    return [listed[url] if url in listed else counted[url] if url in counted else cached[url][1] for url in urls]
