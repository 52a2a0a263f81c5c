"""How ``naflex-accum train`` ends: its exit statuses, and which failures are the transient class.

Invariant: every way a run ends maps to one status (``EXIT_CODES``), the same on every rank, so a cluster
script can act on it; ``transient(exc)`` is the one place that says what counts as 74 (requeue it).
docs/long-runs.md, "Exit codes".
"""
from typing import Optional

from ...data import loader_failure
from ...errors import TransientError, WriteError, storage_gone
from ...interrupt import EXIT_INTERRUPTED
from .preempt import EXIT_STOPPED

EXIT_NONFINITE = 3
EXIT_LOADER = 74  # sysexits' EX_IOERR: the input (or the storage) failed; the saved checkpoints are intact
EXIT_CODES = {0: "finished", 2: "bad setting or unwritable run folder: full, read-only, no permission (one line)",
              EXIT_NONFINITE: "stopped: non-finite loss or weights, nothing saved after it", EXIT_LOADER:
              "stopped: a data-loader worker died, raised or stopped answering, the loader sent no batch for "
              "--data-timeout, the storage of a shard or of the run folder went away, or a rank froze or was "
              "killed (one line); nothing saved after the last checkpoint; --resume latest continues",
              EXIT_STOPPED: "stopped on request (SIGTERM, SIGUSR1, STOP) after saving; --resume latest continues",
              EXIT_INTERRUPTED: "interrupted by Ctrl-C (SIGINT; one line): nothing saved after the last checkpoint; "
              "--resume latest continues"}


def transient(exc: BaseException) -> Optional[str]:
    """One line for a failure another attempt may not meet (exit 74), or None."""
    what = loader_failure(exc)
    if what is None and isinstance(exc, TransientError):
        what = str(exc)
    if what is None and isinstance(exc, WriteError) and storage_gone(exc.errno):
        what = f"{exc}: the run folder's storage failed or went away"
    return what
