"""Reading shards into raw samples: tar members grouped by key, checked, shuffled.

Invariant: ``sample_stream`` yields only samples with image bytes of a
recognisable format (a JPEG/PNG/WebP signature, or a file Pillow identifies) and
a non-empty UTF-8 caption; everything else (a missing or garbage image, a
missing caption, an unreadable or truncated tar) is skipped and recorded in a
``Corruption`` report, never raised, so one bad shard cannot stop training. The
one exception is a shard set with no usable sample at all: once every distinct
shard has been read with nothing usable since the last good sample, it raises a
``UsageError`` instead of spinning forever. No image header is parsed here: the
samples that pass only through the shuffle buffer cost a signature check; the
decode stage (``images.inspect``) reads headers.
"""
import random
import re
from typing import Dict, Iterable, Iterator, List, NamedTuple, Optional, Tuple

from ..errors import UsageError
from .images import readable

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


def tar_members(url: str) -> Iterator[Tuple[str, bytes]]:
    """(file name, bytes) of each regular file in a tar, via webdataset's gopen (paths, file:, pipe:, ...)."""
    from webdataset.gopen import gopen

    from .tario import iter_tar

    stream = gopen(url)
    finished = False
    try:
        yield from iter_tar(stream)
        finished = True
    finally:
        try:
            stream.close()
        except Exception:
            # A pipe closed early (the epoch ended mid-shard) exits non-zero; that is no error.
            if finished:
                raise


def _checked(url: str, key: str, files: Dict[str, bytes], report: Corruption) -> Optional[RawSample]:
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
                sample = _checked(url, key, files, report) if key is not None else None
                if sample is not None:
                    yield sample
                key, files = name, {}
            files[ext] = data
    except Exception as exc:  # truncated/garbage tar, failed pipe: keep what was read, report the rest
        first_line = (str(exc).splitlines() or [""])[0]
        report.add(url, None, f"unreadable shard ({type(exc).__name__}: {first_line})")
    if key is not None:
        sample = _checked(url, key, files, report)
        if sample is not None:
            yield sample


def sample_stream(shards: Iterable[str], report: Corruption, num_distinct: int,
                  flag: str = "--train-data") -> Iterator[RawSample]:
    """Usable samples of the shards in order; a UsageError once all distinct shards came up empty in a row."""
    dry = set()
    for url in shards:
        usable = False
        for sample in shard_samples(url, report):
            usable = True
            dry.clear()
            yield sample
        if not usable:
            dry.add(url)
            if len(dry) >= num_distinct:
                hint = f"; last problem: {report.last}" if report.last else "; the shards hold no samples"
                raise UsageError(f"{flag}: no usable samples in its {num_distinct} shard(s) (each sample needs an "
                                 f"image .{'/.'.join(IMAGE_EXTS)} and a non-empty .txt caption){hint}")


def shuffled(samples: Iterator[RawSample], buffer_size: int, rng: random.Random) -> Iterator[RawSample]:
    """A seeded shuffle buffer: fill up to ``buffer_size`` samples, then emit a random one and refill its slot.

    The fill stops early at the first repeat of a sample already held (a reader whose
    shards hold fewer samples than the buffer has wrapped round to a resampled shard),
    so a small data set does not put several copies of a sample into the buffer, and
    then into one batch.
    """
    if buffer_size <= 1:
        yield from samples
        return
    buffer, held = [], set()
    for sample in samples:
        if held is not None:
            if (sample.url, sample.key) not in held and len(buffer) < buffer_size:
                held.add((sample.url, sample.key))
                buffer.append(sample)
                continue
            held = None  # full, or wrapped round: the buffer's size is fixed from here
        i = rng.randrange(len(buffer))
        yield buffer[i]
        buffer[i] = sample
    # Only a finite stream gets here (validation); the train stream is endless.
    rng.shuffle(buffer)
    yield from buffer
