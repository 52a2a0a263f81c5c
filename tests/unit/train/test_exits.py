"""train.ending.exits: one exit status per way a run ends; transient() says which failures are exit 74."""
import errno

import pytest

from naflex_accum.data.samples import ShardReadError
from naflex_accum.errors import TransientError, UsageError, WriteError
from naflex_accum.train.ending.exits import EXIT_CODES, EXIT_LOADER, EXIT_NONFINITE, transient
from naflex_accum.train.ending.preempt import EXIT_STOPPED


def test_the_statuses_are_the_documented_ones():
    assert sorted(EXIT_CODES) == [0, 2, 3, 74, 75, 130]
    assert (EXIT_NONFINITE, EXIT_LOADER, EXIT_STOPPED) == (3, 74, 75)


@pytest.mark.parametrize("exc, words", [
    (TransientError("no batch within --data-timeout 60 s"), "no batch within --data-timeout 60 s"),
    (ShardReadError("shard x.tar cannot be read"), "shard x.tar cannot be read"),
    (WriteError("/run/out.log", OSError(errno.ESTALE, "Stale file handle")),
     "cannot write /run/out.log: [Errno 116] Stale file handle: the run folder's storage failed or went away"),
    (RuntimeError("Caught ValueError in DataLoader worker process 3.\nTraceback ...\nValueError: bad shard"),
     "loader worker 3 raised ValueError: bad shard"),
])
def test_transient_failures_are_one_line(exc, words):
    assert transient(exc) == words


@pytest.mark.parametrize("exc", [
    WriteError("/run/out.log", OSError(errno.ENOSPC, "No space left on device")),
    WriteError("/run/out.log", OSError(errno.EROFS, "Read-only file system")),
    UsageError("--lr must be positive"), RuntimeError("CUDA out of memory"), KeyboardInterrupt(),
])
def test_settings_to_fix_and_bugs_are_not_transient(exc):
    assert transient(exc) is None
