"""A command's stdout and stderr after their reader has gone (``naflex-accum export CKPT DIR | head -1``).

Invariant: from ``install`` on, a write or flush that finds its pipe closed points that stream's file
descriptor at the null device (Python's advice for a closed stdout) and counts as done, so no
``BrokenPipeError`` reaches the command: it goes on to its own end and exit status, and what it would still
have printed goes nowhere (a run's log is in its ``out.log`` too). Everything else is the stream's own.
Nothing here imports more than Python's start-up has loaded (see ``interrupt``).
"""
import os
import sys


class _Output:
    def __init__(self, stream):
        self._stream = stream

    def write(self, text):
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._reader_gone()
            return len(text)

    def flush(self):
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._reader_gone()

    def _reader_gone(self):
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
        stream = getattr(sys, name)
        if stream is None or isinstance(stream, _Output):
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
