"""output.py: a command's stdout and stderr once they cannot be written; closed-pipe and full-disk runs of every
command are tests/integration/test_closed_stdout.py's."""
import sys

from naflex_accum import output


def test_a_stream_closed_before_the_start_becomes_the_null_device(monkeypatch):
    """``train >&-``: Python starts with ``sys.stdout`` None, and the run's first ``isatty()`` raised."""
    monkeypatch.setattr(sys, "stdout", None)
    output.install()
    stream = sys.stdout
    try:
        print("goes nowhere")
        assert not stream.isatty()
        output.flush()
    finally:
        stream.close()
