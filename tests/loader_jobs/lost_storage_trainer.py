"""``naflex-accum train ARGS`` whose run folder's storage fails once a flag file exists, for the fault tests.

    python lost_storage_trainer.py FLAG ERRNO -- ARGS...

Once FLAG exists, every ``os.open`` of a path under ``--logs-dir`` fails with the OS
error ERRNO (a name: ESTALE, EIO, ENOSPC, EROFS, ...), as a file system whose server went
away (or that filled up, or turned read-only) fails it; every other open is untouched.
An unprivileged process cannot make a real NFS server vanish: this is the one seam faked.
"""
import errno
import os
import sys

FLAG, CODE = sys.argv[1], getattr(errno, sys.argv[2])
argv = sys.argv[sys.argv.index("--") + 1:]
RUNS = os.path.abspath(argv[argv.index("--logs-dir") + 1])
real_open = os.open


def failing_open(path, *args, **kwargs):
    if os.path.exists(FLAG) and os.path.abspath(os.fsdecode(path)).startswith(RUNS + os.sep):
        raise OSError(CODE, os.strerror(CODE), os.fsdecode(path))
    return real_open(path, *args, **kwargs)


os.open = failing_open

from naflex_accum import cli  # noqa: E402

sys.exit(cli.entry(["train", *argv]))
