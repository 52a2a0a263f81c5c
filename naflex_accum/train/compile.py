"""``--torchcompile``: the model compiled with ``torch.compile`` (upstream's ``model`` strategy).

Invariants: the model is compiled in place (``model.compile()``: no wrapper, so
its state_dict keys, attributes and hooks are the model's own) before DDP wraps
it, as upstream's trainer does; Inductor draws its random numbers with eager's generator
(its ``fallback_random`` option), so patch dropout and dropout draw the same masks compiled
as eager from the same RNG state, and the accumulation replay, which restores the
caching pass's RNG state, draws the caching pass's masks under compile too. A NaFlex run has few sequence lengths
and one batch size per length: with the batch dimension marked dynamic
(``mark_batch_dynamic``) the first length compiles a graph per grad mode (the
caching pass runs without grad), the second a dynamic one that every later
length and batch size reuses (dynamo's automatic dynamic shapes), so nothing
compiles after the first epoch; this compile's recompile limit is raised to hold
them all, so no length silently falls back to eager. Under DDP with
``--grad-checkpointing`` dynamo's DDP graph split is turned off, as upstream
(it breaks checkpointed graphs).
"""
import logging

import torch
import torch._dynamo.config as dynamo_config  # optimize_ddp has no public form (pyproject.toml)
import torch._inductor

from ..errors import UsageError

log = logging.getLogger(__name__)
STRATEGIES = ("model",)
TORCH_RECOMPILE_LIMIT = 8  # torch.compile's default; never lowered


def compile_model(model, args, distributed: bool = False) -> None:
    """``model.compile()`` in place with the run's backend and mode; its recompile limit set for the run's
    sequence lengths."""
    if distributed and args.grad_checkpointing:
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
        raise UsageError(f"{flag} {mode if flag.endswith('mode') else backend}: "
                         f"{(str(exc).splitlines() or [''])[0]}") from None
    log.info(f"torch.compile: the model ({backend}{f', mode {mode}' if mode else ''}), batch dimension dynamic, "
             f"Inductor on eager's random numbers")


def mark_batch_dynamic(batch) -> None:
    """Mark dim 0 of every tensor in a (nested) batch dynamic, where it is more than 1."""
    if isinstance(batch, dict):
        for value in batch.values():
            mark_batch_dynamic(value)
    elif isinstance(batch, torch.Tensor) and batch.dim() > 0:
        torch._dynamo.maybe_mark_dynamic(batch, 0)  # no torch.compiler form (pyproject.toml)
