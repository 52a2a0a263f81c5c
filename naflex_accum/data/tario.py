"""Reading tar streams member by member: ``(file name, bytes)`` of each regular file, in archive order.

Invariant: yields exactly the regular files (and names) Python's ``tarfile`` stream mode yields, less
webdataset's ``__*__`` metadata; a damaged archive raises ``tarfile.ReadError`` after the members before the
damage. Plain tars are parsed here, a header at a time (microseconds a member, not tarfile's tens);
compressed ones go through ``tarfile`` itself.
"""
import os
import re
import tarfile
import zlib
from typing import BinaryIO, Callable, Dict, Iterator, Optional, Tuple

BLOCK = 512
_ZERO_BLOCK = bytes(BLOCK)
_REGULAR = (b"0", b"\0", b"7")
_COMPRESSED = (b"\x1f\x8b", b"BZh", b"\xfd7zXZ\x00")
_SKIP_META = re.compile(r"__[^/]*__($|/)")  # webdataset's default: keys like __key__ are metadata


def _read_exact(stream: BinaryIO, n: int) -> bytes:
    data = stream.read(n)
    if len(data) == n or not data:
        return data
    parts = [data]  # pipes and sockets may return less than asked
    got = len(data)
    while got < n:
        more = stream.read(n - got)
        if not more:
            break
        parts.append(more)
        got += len(more)
    return b"".join(parts)


def _number(field: bytes) -> int:
    if field[:1] and field[0] & 0x80:  # GNU base-256 for sizes of 8 GiB and more
        return int.from_bytes(field[1:], "big")
    try:  # the usual octal digits, NUL- or space-terminated
        return int(field.rstrip(b"\0 ") or b"0", 8)
    except ValueError:
        pass
    digits = field.split(b"\0", 1)[0].strip()
    try:
        return int(digits, 8) if digits else 0
    except ValueError:
        raise tarfile.ReadError(f"invalid header (number field {digits[:12]!r})") from None


def _checksum_ok(block: bytes) -> bool:
    # The stored checksum is the byte sum with its own 8 bytes counted as spaces. adler32's low half is
    # 1 + byte sum mod 65521: C speed, and a garbage block still fails with probability 1 - 1/65521.
    stored = _number(block[148:156])
    total = (zlib.adler32(block) & 0xFFFF) - 1 - sum(block[148:156]) + 8 * 32
    return (total - stored) % 65521 == 0


def _name(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")


def _pax(data: bytes) -> Dict[str, str]:
    """``"<len> key=value\\n"`` records of a pax extended header."""
    out, pos = {}, 0
    while pos < len(data):
        space = data.find(b" ", pos)
        if space < 0:
            break
        length = int(data[pos:space])
        if length <= 0:
            raise tarfile.ReadError("invalid pax header")
        key, _, value = data[space + 1:pos + length - 1].partition(b"=")
        out[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        pos += length
    return out


class _Prefixed:
    """A stream whose first bytes were already read: hands them back first (for ``tarfile``)."""

    def __init__(self, head: bytes, stream: BinaryIO):
        self.head, self.stream = head, stream

    def read(self, n: int = -1) -> bytes:
        if not self.head:
            return self.stream.read(n)
        if n is None or n < 0:
            data, self.head = self.head + self.stream.read(), b""
            return data
        data, self.head = self.head[:n], self.head[n:]
        return data + (self.stream.read(n - len(data)) if len(data) < n else b"")


def _via_tarfile(stream, want: Callable[[str], bool]) -> Iterator[Tuple[str, Optional[bytes]]]:
    with tarfile.open(fileobj=stream, mode="r|*") as tar:
        for info in tar:
            if info.isreg() and not _SKIP_META.match(info.name):
                # a member not wanted is still decompressed (a stream cannot seek), but not copied out
                yield info.name, tar.extractfile(info).read() if want(info.name) else None
            tar.members = []  # stream mode would otherwise keep every header of the shard


class _Chunked:
    """Reads a stream a megabyte at a time and hands out exact slices: one read call per chunk, not per field."""

    CHUNK = 1 << 20

    def __init__(self, stream: BinaryIO):
        self.stream, self.buffer, self.pos = stream, b"", 0

    def take(self, n: int) -> bytes:
        """The next ``n`` bytes (fewer only at the end of the stream)."""
        end = self.pos + n
        if end > len(self.buffer):
            rest = self.buffer[self.pos:]
            self.buffer = rest + _read_exact(self.stream, max(n - len(rest), self.CHUNK))
            self.pos, end = 0, n
        out = self.buffer[self.pos:end]
        self.pos = end
        return out

    def skip(self, n: int) -> int:
        """Pass over the next ``n`` bytes uncopied; how many there were. Past the buffer on a seekable stream it
        seeks, so a cut-short file shows as a short read at the next header."""
        if self.pos + n <= len(self.buffer):
            self.pos += n
            return n
        rest = len(self.buffer) - self.pos
        left = _bytes_left(self.stream) if n - rest >= self.CHUNK else None
        if left is None:
            return len(self.take(n))
        moved = min(n - rest, left)
        self.stream.seek(moved, 1)
        self.buffer, self.pos = b"", 0
        return rest + moved


def _bytes_left(stream) -> Optional[int]:
    """Bytes from the position of a seekable file to its end; None for a stream that cannot seek (pipes)."""
    try:
        if not stream.seekable():
            return None
        return max(0, os.fstat(stream.fileno()).st_size - stream.tell())
    except (AttributeError, OSError, ValueError):
        return None


def _everything(name: str) -> bool:
    return True


def iter_tar(stream: BinaryIO, want: Optional[Callable[[str], bool]] = None
             ) -> Iterator[Tuple[str, Optional[bytes]]]:
    """``(name, data)`` of each regular file of the tar archive read from ``stream``; a member ``want(name)``
    refuses comes as ``(name, None)``, its data passed over (seeked past where the stream allows)."""
    reader = _Chunked(stream)
    block = reader.take(BLOCK)
    if not block:
        raise tarfile.ReadError("empty file")
    want = want or _everything
    if block.startswith(_COMPRESSED):
        yield from _via_tarfile(_Prefixed(reader.buffer, stream), want)
        return
    long_name: Optional[str] = None
    pax: Dict[str, str] = {}
    while block and block != _ZERO_BLOCK:
        if len(block) < BLOCK:
            raise tarfile.ReadError("unexpected end of data")
        if not _checksum_ok(block):
            raise tarfile.ReadError("bad checksum in tar header")
        kind, size = block[156:157], _number(block[124:136])
        if pax:
            size = int(pax.get("size", size))
        if size < 0:
            raise tarfile.ReadError("invalid header (negative size)")
        padded = -(-size // BLOCK) * BLOCK
        if kind in _REGULAR:
            name = pax.get("path") or long_name
            if name is None:
                name = _name(block[:100])
                if block[345] != 0:  # a ustar prefix, applied as tarfile applies it
                    name = f"{_name(block[345:500])}/{name}"
            folder = kind == b"\0" and name.endswith("/")  # how pre-POSIX tars mark a folder
            member = not folder and ("__" not in name or not _SKIP_META.match(name))
            if member and want(name):
                data = reader.take(size)  # the padding is skipped, not copied
                if len(data) < size or reader.skip(padded - size) < padded - size:
                    raise tarfile.ReadError("unexpected end of data")
                yield name, data
            else:
                if reader.skip(padded) < padded:
                    raise tarfile.ReadError("unexpected end of data")
                if member:
                    yield name, None
            long_name, pax = None, {}
            block = reader.take(BLOCK)
            continue
        data = reader.take(size)
        if len(data) < size or reader.skip(padded - size) < padded - size:
            raise tarfile.ReadError("unexpected end of data")
        if kind == b"L":
            long_name = _name(data)
        elif kind == b"x":
            pax = _pax(data)
        elif kind not in (b"g", b"K"):  # global pax defaults and GNU long link names name no regular file
            long_name, pax = None, {}
        block = reader.take(BLOCK)
