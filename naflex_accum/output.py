"""A command's stdout and stderr once they cannot be written: their reader has gone (``export CKPT DIR | head -1``)
or their file's disk is full (``> /dev/full``).

Invariant: from ``install`` on, a write or flush that fails (a closed pipe, ``ENOSPC``, ``EIO``) points the stream
at the null device and counts as done, so no ``OSError`` reaches the command and it runs to its own end and status.
Nothing here imports more than Python's start-up has loaded.
"""
import os
import sys


class _Output:
    def __init__(self, stream):
        self._stream = stream

    def write(self, text):
        try:
            return self._stream.write(text)
        except OSError:  # BrokenPipeError, or a full disk's
            self._unwritable()
            return len(text)

    def flush(self):
        try:
            self._stream.flush()
        except OSError:  # BrokenPipeError, or a full disk's
            self._unwritable()

    def _unwritable(self):
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, self._stream.fileno())
        finally:
            os.close(null)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def install() -> None:
    """``sys.stdout`` and ``sys.stderr`` as above (idempotent; a stream without a file descriptor is left)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name) or open(os.devnull, "w")  # None: closed before the start (`>&-`)
        if isinstance(stream, _Output):
            continue
        try:
            stream.fileno()
        except (AttributeError, OSError, ValueError):  # an in-memory stream (a test's capture) has none
            continue
        setattr(sys, name, _Output(stream))


def flush() -> None:
    """Flush both, a closed reader included: what is still buffered goes out now, not at exit, where Python
    would print the closed pipe's error."""
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
