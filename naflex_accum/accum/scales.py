"""Pure maths of the NaFlex loss scale for one accumulation window (no torch).

Invariant: the scale depends only on the multiset of microbatch sizes (their sum and count), never their order
or the replay, so a split cannot change the update. docs/api.md, "The maths".
"""
import math
from typing import Optional, Sequence, Union

from ..errors import StepError, is_positive_int

LOSS_SCALES = ("none", "linear", "sqrt")



def validate_mode(mode: Optional[str]) -> str:
    """Normalise ``mode`` (``None`` means ``'none'``, as upstream) or raise."""
    if mode is None:
        return "none"
    if mode not in LOSS_SCALES:
        raise StepError(
            f"--naflex-loss-scale {mode!r} is not a known mode; valid modes are "
            f"{', '.join(LOSS_SCALES)}."
        )
    return mode


def validate_reference_batch_size(reference_batch_size) -> int:
    if not is_positive_int(reference_batch_size):
        raise StepError(
            f"NaFlex loss scaling requires a positive --batch-size reference: got "
            f"{reference_batch_size!r}; pass a positive integer (the batch size the "
            f"learning rate was tuned for), or use --naflex-loss-scale none."
        )
    return reference_batch_size


def validate_sizes(sizes: Sequence[int]) -> list:
    sizes = list(sizes)
    if not sizes:
        raise StepError("an accumulation window needs at least one microbatch; got an empty window.")
    bad = [(i, s) for i, s in enumerate(sizes) if not is_positive_int(s)]
    if bad:
        where = ", ".join(f"position {i}: {s!r}" for i, s in bad)
        raise StepError(f"microbatch sizes must be positive integers; got {where} in window {sizes!r}.")
    return sizes


def check_options(mode: Optional[str], reference_batch_size, naflex: bool = True) -> str:
    """Validate a window's flags before anything runs (the reference batch size only where a mode scales NaFlex)."""
    mode = validate_mode(mode)
    if mode != "none" and naflex:
        validate_reference_batch_size(reference_batch_size)
    return mode


def window_loss_scale(
        sizes: Sequence[int],
        reference_batch_size,
        mode: Optional[str],
        naflex: Union[bool, Sequence[bool]] = True,
) -> float:
    """One loss scale for a whole window: 'none' 1.0, 'linear' the mean microbatch size over the reference,
    'sqrt' its square root; a dense window (``naflex``, or one flag per microbatch) 1.0, a mixed one refused."""
    mode = validate_mode(mode)
    sizes = validate_sizes(sizes)
    if not isinstance(naflex, bool):
        flags = list(naflex)
        if len(flags) != len(sizes):
            raise StepError(f"got {len(flags)} NaFlex flags for a window of {len(sizes)} microbatches.")
        naflex = window_is_naflex(flags)
    if mode == "none" or not naflex:
        return 1.0
    ref = validate_reference_batch_size(reference_batch_size)
    scale = sum(sizes) / (len(sizes) * ref)
    return math.sqrt(scale) if mode == "sqrt" else scale


def window_is_naflex(flags: Sequence[bool]) -> bool:
    """True for an all-NaFlex window, False for all-dense; a mix is refused with the positions named."""
    flags = [bool(f) for f in flags]
    if all(flags):
        return True
    if not any(flags):
        return False
    naflex = [i for i, f in enumerate(flags) if f]
    dense = [i for i, f in enumerate(flags) if not f]
    raise StepError(
        f"an accumulation window mixes NaFlex and dense microbatches: NaFlex at "
        f"positions {naflex}, dense at positions {dense}. Feed one kind per window "
        f"(every microbatch with batch['image'] a dict holding 'patches', or none)."
    )
