"""``--torchcompile``: the model compiled with ``torch.compile`` (upstream's ``model`` strategy).

Invariants: compiled in place before DDP (state_dict keys are the model's own); Inductor's ``fallback_random``
draws eager's masks from the same RNG state, so the accumulation replay holds compiled; with the batch
dimension dynamic and the recompile limit raised, nothing compiles after the first epoch and no length falls
back to eager; under DDP, dynamo's graph split at DDP's buckets is off. docs/training.md,
"torch.compile".
"""
import logging

import torch
import torch._dynamo.config as dynamo_config  # optimize_ddp has no public form (pyproject.toml)
import torch._inductor

from ...errors import UsageError, first_line

log = logging.getLogger(__name__)
STRATEGIES = ("model",)
TORCH_RECOMPILE_LIMIT = 8  # torch.compile's default; never lowered


def compile_model(model, args, distributed: bool = False) -> None:
    """``model.compile()`` in place, the run's backend and mode; recompile limit set for its sequence lengths."""
    if distributed:  # the trainer's DDP has a bucket per parameter (train/main.py): the split refuses it
        dynamo_config.optimize_ddp = False
    graphs = 2 * len(args.naflex_seq_lens) * len(args.naflex_patch_sizes) + 2  # grad modes; eval
    backend, mode = args.torchcompile_backend or "inductor", args.torchcompile_mode
    kwargs = dict(backend=backend, recompile_limit=max(TORCH_RECOMPILE_LIMIT, graphs))
    try:
        if backend == "inductor":  # eager's RNG stream: the same masks compiled and eager. torch.compile takes
            # a mode or options, not both: a mode is its options (torch._inductor.list_mode_options, as torch.compile)
            modes = torch._inductor.list_mode_options(mode) if mode else {}
            kwargs["options"] = {**modes, "fallback_random": True}
        elif mode:  # another backend runs eager's random ops
            kwargs["mode"] = mode
        model.compile(**kwargs)
    except RuntimeError as exc:  # an unknown mode or backend: torch's line names the valid ones
        flag = "--torchcompile-mode" if "mode" in str(exc) else "--torchcompile-backend"
        raise UsageError(f"{flag} {mode if flag.endswith('mode') else backend}: {first_line(exc)}") from None
    log.info(f"torch.compile: the model ({backend}{f', mode {mode}' if mode else ''}), batch dimension dynamic"
             + (", Inductor on eager's random numbers" if backend == "inductor" else ""))


def mark_batch_dynamic(batch) -> None:
    """Mark dim 0 of every tensor in a (nested) batch dynamic, where it is more than 1."""
    if isinstance(batch, dict):
        for value in batch.values():
            mark_batch_dynamic(value)
    elif isinstance(batch, torch.Tensor) and batch.dim() > 0:
        torch._dynamo.maybe_mark_dynamic(batch, 0)  # no torch.compiler form (pyproject.toml)
