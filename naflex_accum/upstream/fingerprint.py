"""Fingerprints of the upstream code the patch replaces and relies on, and the ones CI has verified.

Invariant: a fingerprint hashes the source of upstream's ``_train_step_eager`` and the task's
``compute_accum_loss``; ``VERIFIED`` lists the pinned snapshots' (recomputed by
tests/integration/test_upstream_verify.py).
"""
import hashlib
import inspect
from typing import Optional

# fingerprint -> where CI verified it (the pinned snapshots in ../shared/upstream)
VERIFIED = {
    "62713ad1583c7b2a": "upstream 89fb801 (4.2.0.dev0, 2026-06-27): CLIPTask, SigLIPTask",
    "f7c622432d004d7a": "upstream 89fb801 (4.2.0.dev0, 2026-06-27): CoCaTask",
    "6e79100ada0f88d1": "upstream 5964c41 (4.0.0.dev0, 2026-05-22): CLIPTask, SigLIPTask",
    "e22bb01b05c1fa1c": "upstream 5964c41 (4.0.0.dev0, 2026-05-22): CoCaTask",
}


def _source(obj) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):  # no source on disk: the qualified name at least tells versions apart
        return f"<no source: {getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}>"


def fingerprint(step, task_class) -> str:
    """16 hex digits of sha256 over the sources of ``step`` and ``task_class.compute_accum_loss``."""
    text = "\n# --- compute_accum_loss ---\n".join(
        [_source(step), _source(getattr(task_class, "compute_accum_loss", None))])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def verified(value: str) -> Optional[str]:
    """Where CI verified the fingerprint ``value``, or None."""
    return VERIFIED.get(value)


def describe(value: str, task: str) -> str:
    """``value`` with the task it was taken with and whether CI verified it, for logs and run records."""
    where = verified(value)
    return (f"{value} ({task}; verified in CI on {where})" if where
            else f"{value} ({task}; not among the upstream versions CI verified)")
