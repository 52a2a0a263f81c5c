"""What an accumulation step keeps about one window while it fills: sizes, random states, cached outputs.

Invariant: every output but ``logit_scale``/``logit_bias`` is kept per microbatch, detached, with its length
along dim 0, so each key's concatenation is the window's loss input and its gradient splits back exactly; an
output that cannot be concatenated is refused in one line at the microbatch that shows it. The bookkeeping
rides in its ``accum_state`` (``window_cache``) with a weak reference to the first microbatch's model, so a
state reused after its window closed, batches and bookkeeping that disagree, or two models are refused before
the forward. In-place changes to a batch's tensors are not seen. docs/api.md, "Misuse the step refuses".
"""
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch
import torch.nn as nn

from ..errors import StepError, is_positive_int
from .rng import RngState

LOGIT_KEYS = ("logit_scale", "logit_bias")
# accum_features belongs to the step (upstream's loop only carries it between
# calls), so the window's bookkeeping rides in it under a key no model emits;
# once the window's backward has begun the key holds a string saying why it is closed (a string, so a
# pickled or copied closed state still reads as closed).
WINDOW_KEY = "_naflex_accum_window"
SPENT = "failed after its forwards (in its loss, backward or optimizer step)"
STEPPED = "has already made its optimizer step"
FRESH = "start each window with accum_state=([], {}) and pass the accum_state the step returned"


@dataclass
class Microbatch:
    size: int
    naflex: bool
    rng: RngState


@dataclass
class Window:
    microbatches: List[Microbatch]
    mode: str
    scale: float
    reference_batch_size: Optional[int] = None

    @property
    def sizes(self) -> List[int]:
        return [mb.size for mb in self.microbatches]


def unwrap(module: nn.Module) -> nn.Module:
    """The model inside a DDP wrapper. torch.compile adds none: the trainer compiles in place
    (``model.compile()``), and a ``torch.compile(model)`` wrapper passes attribute reads to the model."""
    return getattr(module, "module", module)


class ModelRef:
    """A weak reference to microbatch 0's model, shared by a deep copy; an unpickled window holds none."""

    def __init__(self, module):
        self.ref = weakref.ref(module)

    def __call__(self):
        return self.ref() if self.ref is not None else None

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __getstate__(self):
        return {"ref": None}


def _named(module) -> str:
    return f"{type(module).__name__} at {id(module):#x}"


def is_naflex_batch(batch) -> bool:
    image = batch.get("image") if isinstance(batch, dict) else None
    return isinstance(image, dict) and "patches" in image


def microbatch_size(task, batch, position: int) -> int:
    size = task.batch_size(batch)
    if not is_positive_int(size):
        raise StepError(
            f"the microbatch at position {position} of the window has size {size!r}; "
            f"every microbatch needs at least one sample.")
    return size


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{list(value.shape)} {str(value.dtype).replace('torch.', '')}"
    return type(value).__name__


@dataclass
class WindowCache:
    """The microbatches admitted so far and their cached outputs, in order."""

    model: Optional[ModelRef] = None  # microbatch 0's model (a compile wrapper aside): every one must come through it
    microbatches: List[Microbatch] = field(default_factory=list)
    batches: List[Any] = field(default_factory=list)  # the batch objects admitted, to tell one replaced by hand
    features: Dict[str, List[torch.Tensor]] = field(default_factory=dict)
    logits: Dict[str, torch.Tensor] = field(default_factory=dict)
    added: int = 0  # microbatches whose outputs are kept

    def add(self, model_out: Dict) -> None:
        """Keep one microbatch's outputs (detached); refuse what cannot be concatenated over the window."""
        position = self.added
        missing = [key for key in self.features if key not in model_out]
        if missing:
            raise StepError(f"model output {missing[0]!r} is missing from microbatch {position} of the window "
                             f"(earlier microbatches had it); every microbatch must return the same keys.")
        for key, value in model_out.items():  # every key checked before any is kept: a refusal keeps nothing
            if key not in LOGIT_KEYS:
                self._check(key, value, position)
        for key, value in model_out.items():
            if key in LOGIT_KEYS:
                self.logits[key] = value.detach()  # parameters: the same for every microbatch
            else:
                self.features.setdefault(key, []).append(value.detach())
        self.added += 1

    def _check(self, key: str, value, position: int) -> None:
        earlier = self.features.get(key)
        if earlier is None and position > 0:
            raise StepError(f"model output {key!r} appears at microbatch {position} of the window but not "
                             f"before; every microbatch must return the same keys.")
        first = earlier[0] if earlier else None
        ok = isinstance(value, torch.Tensor) and value.dim() >= 1 and (
            first is None or (value.shape[1:] == first.shape[1:] and value.dtype == first.dtype))
        if not ok:
            seen = f"microbatch 0 gave {_describe(first)}, microbatch {position} gave " if first is not None else \
                f"microbatch {position} gave "
            raise StepError(
                f"model output {key!r} cannot be accumulated: {seen}{_describe(value)}; accumulation "
                f"concatenates every output but logit_scale/logit_bias over a window's microbatches along dim 0, "
                f"so each must be a tensor with a leading dimension and the same other dimensions and dtype "
                f"in every microbatch.")

    def check_model(self, module) -> None:
        """Refuse a microbatch through another model than the window's first (a new torch.compile wrapper is the
        same model; a DDP wrapper is not: the gradient sync rides on it)."""
        module, position = getattr(module, "_orig_mod", module), len(self.batches)
        if not position:
            self.model = ModelRef(module)
            return
        first = self.model() if self.model is not None else None
        if first is None:
            raise StepError(f"microbatch {position} of the window cannot be checked against microbatch 0's model: "
                            f"the state was pickled, or that model no longer exists; {FRESH}.")
        if module is not first:
            raise StepError(
                f"microbatch {position} of the window came through another model than microbatch 0 "
                f"(task.trainable_module's: {_named(module)}; microbatch 0's: {_named(first)}); a window's "
                f"microbatches must all go through one model: {FRESH}, one per model.")

    def take(self, record: Microbatch, batch) -> None:
        self.microbatches.append(record)
        self.batches.append(batch)

    def forget_last(self) -> None:
        """Undo the last ``take`` (its forward failed, so none of its outputs are kept)."""
        self.microbatches.pop()
        self.batches.pop()

    def lengths(self, key: str) -> List[int]:
        return [t.shape[0] for t in self.features[key]]

    def concatenated(self) -> Dict[str, torch.Tensor]:
        """Each key's outputs over the window, in microbatch order (one copy per key)."""
        return {key: torch.cat(parts) for key, parts in self.features.items()}

    def with_live(self, j: int, model_out: Dict) -> Dict[str, torch.Tensor]:
        """The window's outputs with microbatch ``j``'s taken live from ``model_out`` (upstream's replay inputs)."""
        return {key: torch.cat(parts[:j] + [model_out[key]] + parts[j + 1:]) for key, parts in self.features.items()}


def window_cache(accum_state) -> WindowCache:
    """The window bookkeeping in ``accum_state`` (new for an empty state), refused unless it is the state's own."""
    pair = isinstance(accum_state, (tuple, list))
    if not (pair and len(accum_state) == 2 and isinstance(accum_state[0], list) and isinstance(accum_state[1], dict)):
        parts = f" ({', '.join(type(v).__name__ for v in accum_state)})" if pair else ""
        raise StepError(f"accum_state must be a (list, dict) pair, ([], {{}}) at a window's start; got a "
                        f"{type(accum_state).__name__}{parts}.")
    batches, features = accum_state
    cache = features.get(WINDOW_KEY)
    if isinstance(cache, str):
        raise StepError(f"this accum_state's window {cache}, so it cannot take another microbatch; {FRESH}.")
    if cache is None:
        if batches:
            raise StepError(f"accum_state has {len(batches)} in its batch list but this step admitted none of them "
                            f"(a window begun by another step, or a used state's batch list); {FRESH}.")
        cache = features[WINDOW_KEY] = WindowCache()
    elif not len(batches) == len(cache.batches) == cache.added:
        raise StepError(f"accum_state has {len(batches)} in its batch list but its window kept outputs of "
                        f"{cache.added} (a state copied or mixed with another, or a batch added by hand); {FRESH}.")
    else:
        replaced = next((j for j, (b, kept) in enumerate(zip(batches, cache.batches)) if b is not kept), None)
        if replaced is not None:
            raise StepError(f"accum_state's batch list holds another batch at position {replaced} than the one the "
                            f"step admitted there (a batch replaced by hand, or a state mixed with another); "
                            f"{FRESH}.")
    return cache
