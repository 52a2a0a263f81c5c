"""``--fsdp``: FSDP2 (``fully_shard``) in the built-in trainer, and full state dicts in and out of it.

Invariants: every block of both towers, and the root, is a ``fully_shard`` unit, all fp32, so the update is a
DDP run's to round-off; checkpoints hold the plain model's full state dict and a name-keyed optimizer state,
so runs with and without ``--fsdp`` resume from either. Every function here is a collective under FSDP.
docs/distributed.md, "FSDP2".
"""
import logging
from typing import Dict, Optional

import torch
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

log = logging.getLogger(__name__)
LOGIT_KEYS = ("logit_scale", "logit_bias")


def sharded(model) -> bool:
    return any(hasattr(p, "to_local") for p in model.parameters())


def _unit_modules(model):
    visual = getattr(getattr(model, "visual", None), "trunk", None)
    blocks = list(getattr(visual, "blocks", []))
    text = getattr(getattr(model, "transformer", None), "resblocks", [])
    return blocks + list(text)


def shard(model, world, args):
    """Shard ``model`` in place (blocks, then the root); returns it. The logit parameters become 1-dim."""
    for name in LOGIT_KEYS:  # fully_shard cannot shard a 0-dim parameter
        value = getattr(model, name, None)
        if isinstance(value, torch.nn.Parameter) and value.dim() == 0:
            setattr(model, name, torch.nn.Parameter(value.detach().reshape(1), requires_grad=value.requires_grad))
    device = next(model.parameters()).device
    mesh = init_device_mesh(device.type, (world.world_size,))
    reshard = not args.fsdp_no_reshard_after_forward
    units = _unit_modules(model)
    for block in units:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    log.info(f"FSDP2: {len(units)} blocks and the root sharded over {world.world_size} ranks, fp32 parameters, "
             f"reshard after forward {reshard}")
    return model


def _plain(state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    return {k: (v.reshape(()) if k in LOGIT_KEYS and v.numel() == 1 else v) for k, v in state.items()}


def fit_shapes(state: Dict, shapes: Dict[str, torch.Size]) -> Dict:
    """``state`` with its logit entries reshaped to this model's (0-dim plain, 1-dim sharded)."""
    return {k: (v.reshape(shapes[k]) if k in LOGIT_KEYS and k in shapes and torch.is_tensor(v)
                and v.numel() == 1 else v) for k, v in state.items()}


def model_shapes(model) -> Dict[str, torch.Size]:
    return {k: v.shape for k, v in model.state_dict().items()}


def full_model_state(model) -> Optional[Dict[str, torch.Tensor]]:
    """A sharded model's whole state on the CPU, in the plain form (on rank 0; None elsewhere)."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return _plain(state) if state else None


def load_model_state(model, state: Dict[str, torch.Tensor]) -> None:
    """Load a full state dict (plain form or this model's) into ``model``, sharded or not."""
    state = fit_shapes(state, model_shapes(model))
    if not sharded(model):
        model.load_state_dict(state)
        return

    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))


def full_optimizer_state(model, optimizer) -> Optional[Dict]:
    """The optimizer's state keyed by parameter name, on the CPU (rank 0; None elsewhere when sharded)."""
    state = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not state:
        return None
    state["state"] = {name: _plain_entry(name, entry) for name, entry in state["state"].items()}
    return state


def _plain_entry(name: str, entry: Dict) -> Dict:
    if name not in LOGIT_KEYS:
        return entry
    return {k: (v.reshape(()) if torch.is_tensor(v) and v.numel() == 1 and k != "step" else v)
            for k, v in entry.items()}


def by_name(model, optimizer, state: Dict) -> Dict:
    """An ``optimizer.state_dict()`` (parameters by index) with parameters by name instead."""
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    saved = [i for group in state["param_groups"] for i in group["params"]]
    index = dict(zip(saved, order))
    groups = [{**group, "params": [index[i] for i in group["params"]]} for group in state["param_groups"]]
    return {"state": {index[i]: entry for i, entry in state["state"].items()}, "param_groups": groups}


def keyed_by_index(state: Dict) -> bool:
    """Whether an optimizer state names its parameters by index (``optimizer.state_dict()``), not by name."""
    keys = list(state["state"]) or [i for group in state["param_groups"] for i in group["params"]]
    return bool(keys) and isinstance(keys[0], int)


def load_optimizer_state(model, optimizer, state: Dict) -> None:
    """Load an optimizer state saved by a run with or without ``--fsdp`` (by name or by index)."""
    if keyed_by_index(state):
        state = by_name(model, optimizer, state)
    shapes = {n: p.shape for n, p in model.named_parameters()}
    state = {**state, "state": {n: {k: (v.reshape(shapes[n]) if n in LOGIT_KEYS and torch.is_tensor(v)
                                        and v.numel() == 1 and k != "step" else v) for k, v in entry.items()}
                                for n, entry in state["state"].items()}}
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


def weights_finite(model, world) -> bool:
    """Whether every parameter and buffer is finite, every rank's shard included (one device read)."""
    flags = [torch.isfinite(t.to_local() if hasattr(t, "to_local") else t).all()
             for t in model.state_dict().values() if t.is_floating_point()]
    bad = (~torch.stack(flags).all()).double().reshape(1) if flags else torch.zeros(1, dtype=torch.float64)
    if sharded(model) and world.distributed:
        bad = world.sum_(bad)
    return not bool(bad.item())
