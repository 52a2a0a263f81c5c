"""Reading shards into samples: tar members grouped by key, numbered, checked.

Invariant: a shard's samples are its runs of members with one key, numbered in tar order, so
``count_samples`` (headers only) and ``shard_groups`` agree on every number; ``checked`` keeps a sample with a
recognisable image and a non-empty UTF-8 caption and reports every other in ``Corruption``, never raising.
An OS error reading a shard raises ``ShardReadError`` (exit 74), never a short count. docs/data.md, "Corrupt data".
"""
import errno
import re
from typing import Callable, Dict, Iterator, List, NamedTuple, Optional, Tuple

from ..errors import TransientError, first_line, storage_gone
from .images import readable
from .pipes import PipeFailed, PipeStream, close_shard, open_shard
from .tario import iter_tar

IMAGE_EXTS = ("jpg", "png", "jpeg", "webp")
CAPTION_EXT = "txt"
MAX_MESSAGES = 100  # kept per drain; the count is always exact
_OBJECT_REPR = re.compile(r"\s*@?\s*<[^<>]*>")


class RawSample(NamedTuple):
    key: str
    url: str
    data: bytes  # the encoded image
    caption: str


class Corruption:
    """Skipped samples since the last ``drain``: an exact count and the first few messages."""

    def __init__(self):
        self.count, self.messages, self.last = 0, [], None

    def add(self, url: str, key: Optional[str], reason: str):
        # Object reprs ("<_io.BytesIO object at 0x..>") would make every repeat of a message unique.
        reason = _OBJECT_REPR.sub("", reason)
        message = f"{url}{'' if key is None else ' key ' + repr(key)}: {reason}"
        self.count += 1
        self.last = message
        if len(self.messages) < MAX_MESSAGES:
            self.messages.append(message)

    def drain(self) -> Tuple[int, List[str]]:
        out = (self.count, self.messages)
        self.count, self.messages = 0, []
        return out


def _split_name(fname: str):
    # webdataset's convention: the key is the path up to the first dot of the file name.
    folder, _, base = fname.rpartition("/")
    stem, dot, ext = base.partition(".")
    if not dot or not stem:
        return None, None
    return (f"{folder}/{stem}" if folder else stem), ext.lower()


class ShardReadError(TransientError):
    """A shard the OS cannot read (storage gone: ENOENT, ESTALE, EIO, ...): the run stops, a later attempt may not."""


def shard_error(url: str, exc: OSError) -> ShardReadError:
    """One line naming the shard and the OS error (and saying so where the error means the storage went away)."""
    name = errno.errorcode.get(exc.errno, "")
    gone = "; its storage failed or went away" if storage_gone(exc.errno) else ""
    return ShardReadError(f"shard {url} cannot be read: [Errno {exc.errno}] {exc.strerror}"
                          f"{f' ({name})' if name else ''}{gone}")


def tar_members(url: str, want: Optional[Callable[[str], bool]] = None) -> Iterator[Tuple[str, Optional[bytes]]]:
    """(file name, bytes) of each regular file in a tar (``pipes.open_shard``); ``want`` as ``tario.iter_tar``'s.
    An OS error (one with an errno; not a failed command or a damaged archive) raises ``ShardReadError``."""
    stream, finished = None, False
    try:
        stream = open_shard(url)
        yield from iter_tar(stream, want)
        finished = True
    except OSError as exc:
        if exc.errno is None:  # gzip's BadGzipFile, a gopen pipe's exit status: the data, not the storage
            raise
        raise shard_error(url, exc) from None
    except Exception as exc:  # output that broke off: a pipe: command that failed says why
        failed = stream.failure() if isinstance(stream, PipeStream) else None
        if failed is None:
            raise
        raise PipeFailed(f"{failed} ({first_line(exc, named=True)})") from None
    finally:
        if stream is not None:
            close_shard(stream, finished)


def checked(url: str, key: str, files: Dict[str, bytes], report: Corruption) -> Optional[RawSample]:
    """The usable sample in ``files`` (a key's members), or None after reporting why it is not."""
    ext = next((e for e in IMAGE_EXTS if e in files), None)
    if ext is None:
        report.add(url, key, f"no image (.{'/.'.join(IMAGE_EXTS)}); has {sorted(files)}")
        return None
    if CAPTION_EXT not in files:
        report.add(url, key, "missing caption (.txt)")
        return None
    try:
        caption = files[CAPTION_EXT].decode("utf-8").strip()
    except UnicodeDecodeError as exc:
        report.add(url, key, f"caption is not UTF-8 ({exc})")
        return None
    if not caption:
        report.add(url, key, "empty caption")
        return None
    try:
        readable(files[ext])
    except Exception as exc:  # PIL raises many types for garbage; all mean "skip this sample"
        report.add(url, key, f"undecodable image .{ext} ({type(exc).__name__}: {exc})")
        return None
    return RawSample(key, url, files[ext], caption)


def shard_samples(url: str, report: Corruption) -> Iterator[RawSample]:
    """Usable samples of one shard, in tar order; a read error ends the shard and is reported."""
    key, files = None, {}
    try:
        for fname, data in tar_members(url):
            name, ext = _split_name(fname)
            if name is None:
                continue
            if name != key:
                sample = checked(url, key, files, report) if key is not None else None
                if sample is not None:
                    yield sample
                key, files = name, {}
            files[ext] = data
    except ShardReadError:
        raise
    except Exception as exc:  # truncated/garbage tar, failed pipe: keep what was read, report the rest
        report.add(url, None, f"unreadable shard ({first_line(exc, named=True)})")
    if key is not None:
        sample = checked(url, key, files, report)
        if sample is not None:
            yield sample


def shard_groups(url: str, start: int = 0, stop: Optional[int] = None
                 ) -> Iterator[Tuple[int, str, Dict[str, bytes]]]:
    """``(number, key, {extension: bytes})`` of samples ``start`` to ``stop`` of one shard, in tar order; those
    before ``start`` passed over by their headers; a read error propagates after the samples before it."""
    state = {"key": None, "index": -1}

    def want(fname: str) -> bool:
        name, _ = _split_name(fname)
        if name is None:
            return False
        if name != state["key"]:
            state["key"], state["index"] = name, state["index"] + 1
        return state["index"] >= start

    current, key, files = -1, None, {}
    for fname, data in tar_members(url, want):
        if data is None:
            continue
        if state["index"] != current:
            if files:
                yield current, key, files
            current, key, files = state["index"], state["key"], {}
            if stop is not None and current >= stop:
                return
        files[_split_name(fname)[1]] = data
    if files:
        yield current, key, files


def count_samples(url: str) -> Tuple[int, Optional[str]]:
    """``(samples, problem)``: the key groups of one shard, from its headers alone, and None, or the
    samples before a read error and that error in one line."""
    count, key = 0, None
    try:
        for fname, _ in tar_members(url, lambda name: False):
            name, _ = _split_name(fname)
            if name is not None and name != key:
                key, count = name, count + 1
    except ShardReadError:
        raise
    except Exception as exc:  # truncated/garbage tar, failed pipe: the samples before it still count
        return count, first_line(exc, named=True)
    return count, None
