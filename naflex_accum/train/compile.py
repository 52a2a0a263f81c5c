"""``--torchcompile``: the model compiled with ``torch.compile`` (upstream's ``model`` strategy).

Invariants: the model is compiled before DDP wraps it, as upstream's trainer
does; Inductor draws its random numbers with eager's generator
(``fallback_random``), so patch dropout and dropout draw the same masks compiled
as eager from the same RNG state, and the accumulation replay, which restores the
caching pass's RNG state, draws the caching pass's masks under compile too. A NaFlex run has few sequence lengths
and one batch size per length: with the batch dimension marked dynamic
(``mark_batch_dynamic``) the first length compiles a graph per grad mode (the
caching pass runs without grad), the second a dynamic one that every later
length and batch size reuses (dynamo's automatic dynamic shapes), so nothing
compiles after the first epoch; the recompile limit is raised to hold them all,
so no length silently falls back to eager. Under DDP with
``--grad-checkpointing`` dynamo's DDP graph split is turned off, as upstream
(it breaks checkpointed graphs).
"""
import logging

import torch
import torch._dynamo.config as dynamo_config
import torch._inductor.config as inductor_config

log = logging.getLogger(__name__)
STRATEGIES = ("model",)


def compile_model(model, args, distributed: bool = False):
    """``torch.compile(model)`` with the run's backend and mode; the limits set for its sequence lengths."""
    if distributed and args.grad_checkpointing:
        dynamo_config.optimize_ddp = False
    inductor_config.fallback_random = True  # eager's RNG stream: the same masks compiled and eager
    graphs = 2 * len(args.naflex_seq_lens) * len(args.naflex_patch_sizes) + 2  # grad modes; eval
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, graphs)
    kwargs = {key: value for key, value in (("backend", args.torchcompile_backend),
                                            ("mode", args.torchcompile_mode)) if value}
    log.info(f"torch.compile: the model ({', '.join(f'{k} {v}' for k, v in kwargs.items()) or 'inductor'}), "
             f"batch dimension dynamic, Inductor on eager's random numbers")
    return torch.compile(model, **kwargs)


def mark_batch_dynamic(batch) -> None:
    """Mark dim 0 of every tensor in a (nested) batch dynamic, where it is more than 1."""
    if isinstance(batch, dict):
        for value in batch.values():
            mark_batch_dynamic(value)
    elif isinstance(batch, torch.Tensor) and batch.dim() > 0:
        torch._dynamo.maybe_mark_dynamic(batch, 0)
