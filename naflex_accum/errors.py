"""User-facing errors.

Invariant: a ``UsageError`` message is one line that names the flag or file at
fault and what would be valid; the CLI prints it and exits 2, no traceback.
"""


class UsageError(ValueError):
    pass
