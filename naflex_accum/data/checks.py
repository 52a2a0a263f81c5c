"""The data settings' one integer validator: a value, or a one-line ``UsageError`` naming its flag."""
from typing import Optional

from ..errors import UsageError


def check_int(value, flag: str, minimum: int = 1, noun: Optional[str] = None) -> int:
    """``value`` if it is an int (not a bool) of at least ``minimum``; else a UsageError.

    The message says "a positive integer" for ``minimum`` 1 and "an integer >= N"
    otherwise, unless ``noun`` words it.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        noun = noun or ("a positive integer" if minimum == 1 else f"an integer >= {minimum}")
        raise UsageError(f"{flag} must be {noun}, got {value!r}")
    return value
