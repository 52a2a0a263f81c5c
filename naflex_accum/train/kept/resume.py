"""Training state to a checkpoint payload and back, with the checks that make a resume exact or refused.

Invariants: a payload holds everything the rest of the run depends on (state, counters, the epoch's position,
every rank's random state, ``SCHEDULE_FLAGS``); at the saved world size an epoch goes on exactly, at another
in the same global sample order; a resume that would not continue the same run is a one-line ``UsageError``
before the run folder is touched. docs/long-runs.md, "Resuming" and "Elastic resume".
"""
import logging
from typing import Optional

import torch
from timm.models import clean_state_dict

from ...accum.rng import RngState
from ...data import Segment, check_slots
from ...errors import UsageError
from ..model import fsdp
from ..model.finetune import mismatch

log = logging.getLogger(__name__)

# The flags that decide an epoch's batches (not the world size nor --workers: the sample order depends on neither)
SCHEDULE_FLAGS = ("accum_freq", "naflex_max_tokens_per_batch", "naflex_seq_lens", "naflex_seq_len_probs",
                  "naflex_patch_sizes", "naflex_batch_divisor", "train_num_samples", "naflex_num_train_image_tokens",
                  "seed", "dataset_resampled", "train_data_upsampling_factors", "sample_shuffle_size")
# The sample order a mid-epoch payload's position refers to (data.slots); a payload of another one cannot go on.
ORDER = 2


def schedule_settings(args, world) -> dict:
    return {name: _plain(getattr(args, name)) for name in SCHEDULE_FLAGS if hasattr(args, name)}


def _plain(value):
    return list(value) if isinstance(value, (list, tuple)) else value


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def gather_states(state, model):
    """``(model state, optimizer state)`` of a sharded (``--fsdp``) model, whole, on rank 0 (a collective);
    ``(None, None)`` for an unsharded one, whose payload reads them where it is made."""
    if not fsdp.sharded(model):
        return None, None
    return fsdp.full_model_state(model), fsdp.full_optimizer_state(model, state.optimizer)


def epoch_payload(state, model, args, states=(None, None)) -> dict:
    """The state at an epoch boundary (open_clip's checkpoint keys); ``states`` from ``gather_states``."""
    model_state, optimizer_state = states
    return {"epoch": state.epoch, "global_step": state.global_step, "samples_seen": state.samples_seen,
            "lr_steps_per_epoch": state.lr_steps_per_epoch, "name": args.name,
            "naflex_patch_sizes": list(args.naflex_patch_sizes),
            "state_dict": model.state_dict() if model_state is None else model_state,
            "optimizer": state.optimizer.state_dict() if optimizer_state is None else optimizer_state,
            "scaler": state.scaler.state_dict() if state.scaler is not None else None}


def gather_rng_states(world) -> list:
    """Every rank's random state, in rank order (a collective: every rank calls it)."""
    return world.gather_object(RngState.current().to_dict())


def mid_epoch_payload(state, model, args, world, rng_states, states=(None, None)) -> dict:
    """The state after step ``state.step_in_epoch`` of epoch ``state.epoch``."""
    payload = epoch_payload(state, model, args, states)
    payload.update(step_in_epoch=state.step_in_epoch, rng_states=rng_states,
                   schedule=schedule_settings(args, world), segment=state.segment.to_dict(),
                   epoch_samples=state.epoch_samples, epoch_tokens=state.epoch_tokens, order=ORDER,
                   shards=state.data_listing, meters=state.meters or {})
    return payload


def check_fits(model, state_dict: dict, where: str, model_name: str) -> dict:
    """``state_dict`` without DDP's ``module.`` prefix, or a UsageError naming the first mismatches."""
    theirs = clean_state_dict(state_dict)
    ours = model.state_dict()
    theirs = fsdp.fit_shapes(theirs, {k: v.shape for k, v in ours.items()})  # 0-dim or 1-dim logit parameters alike
    problem = mismatch(ours, theirs)
    if problem:
        raise UsageError(f"{where} does not fit --model {model_name}: {problem}")
    return theirs


def check_schedule(saved: Optional[dict], args, world, where: str, step: int, epoch: int) -> None:
    """A checkpoint from inside an epoch continues only under the settings that made that epoch's batches."""
    if saved is None:
        return
    now = schedule_settings(args, world)
    differ = [name for name in now if name in saved and saved[name] != now[name]]
    if differ:
        what = ", ".join(f"{_flag(n)} {saved[n]} (now {now[n]})" for n in differ)
        raise UsageError(f"{where} was saved at step {step} inside epoch {epoch} with {what}: resume it with "
                         f"the saved settings, or from an epoch_K.pt checkpoint")


def _check_shards(saved, now, where: str, epoch: int) -> None:
    """The rest of an epoch is the saved shard list's: another list (or other sizes) would repeat and miss."""
    if saved is None or now is None or [list(x) for x in saved] == [list(x) for x in now]:
        return
    saved_urls, now_urls = [u for u, _ in saved], [u for u, _ in now]
    gone = [u for u in saved_urls if u not in set(now_urls)]
    new = [u for u in now_urls if u not in set(saved_urls)]
    if gone or new:
        what = f"{len(gone)} shard(s) gone (first {gone[0]!r})" if gone else f"{len(new)} new (first {new[0]!r})"
    else:
        changed = [u for (u, a), (_, b) in zip(sorted(saved), sorted(now)) if a != b]
        what = f"{len(changed)} shard(s) of another size (first {changed[0]!r})" if changed else "another order"
    raise UsageError(f"{where} was saved inside epoch {epoch} with another --train-data ({what}): the rest of the "
                     f"epoch needs the saved shards; restore them, or resume from an epoch_K.pt checkpoint")


def _saved_segment(payload: dict, where: str, args, world, state_listing=None) -> Segment:
    """The segment a mid-epoch payload was saved in, checked against this run's world size and flags."""
    step_in_epoch, epoch = int(payload["step_in_epoch"]), int(payload["epoch"])
    check_schedule(payload.get("schedule"), args, world, where, step_in_epoch, epoch)
    if "segment" not in payload or payload.get("order") != ORDER:
        raise UsageError(f"{where} was saved inside epoch {epoch} by a naflex-accum with another sample order, "
                         f"whose batches this version cannot rebuild; resume from an epoch_K.pt checkpoint")
    _check_shards(payload.get("shards"), state_listing, where, epoch)
    segment = Segment.from_dict(payload["segment"])
    slots = getattr(args, "data_slots", None)
    if slots is not None and slots != segment.slots:
        raise UsageError(f"{where} was saved inside epoch {epoch} with --data-slots {segment.slots} (now "
                         f"{slots}): the rest of the epoch needs its order; drop --data-slots or resume "
                         f"from an epoch_K.pt checkpoint")
    if segment.world_size != world.world_size:
        check_slots(segment.slots, world.world_size, f"{where}: saved at world size {segment.world_size} with "
                                                     f"--data-slots")
    elif len(payload["rng_states"]) != world.world_size:
        raise UsageError(f"{where}: saved by {len(payload['rng_states'])} ranks at world size "
                         f"{segment.world_size}: the checkpoint is inconsistent; resume from another one")
    return segment


def restore(state, model, payload: dict, where: str, args, world) -> None:
    """Load ``payload`` into the model and ``state``; for a mid-epoch payload, where the epoch stopped
    (``state.segment``), and this rank's random state when the world size is the saved one."""
    step_in_epoch, epoch = int(payload.get("step_in_epoch", 0)), int(payload["epoch"])
    segment = _saved_segment(payload, where, args, world, state.data_listing) if step_in_epoch else None
    fsdp.load_model_state(model, check_fits(model, payload["state_dict"], where, args.model))
    try:
        saved = payload["optimizer"]
        if fsdp.sharded(model) or not fsdp.keyed_by_index(saved):
            fsdp.load_optimizer_state(model, state.optimizer, saved)  # by name: saved by an --fsdp run
        else:
            state.optimizer.load_state_dict(saved)
        if state.scaler is not None and payload.get("scaler") is not None:
            state.scaler.load_state_dict(payload["scaler"])
    except (ValueError, KeyError, RuntimeError, TypeError) as exc:
        raise UsageError(f"{where}: its optimizer state does not fit this run ({exc})") from None
    state.epoch, state.step_in_epoch = epoch, step_in_epoch
    state.global_step = int(payload.get("global_step", 0))
    state.samples_seen = int(payload.get("samples_seen", 0))
    state.lr_steps_per_epoch = int(payload.get("lr_steps_per_epoch") or state.lr_steps_per_epoch)
    state.segment, state.rng_state = segment, None
    if segment is not None:
        state.epoch_samples, state.epoch_tokens = int(payload["epoch_samples"]), int(payload["epoch_tokens"])
        state.meters = payload.get("meters") or None
        if segment.world_size == world.world_size:
            state.rng_state = payload["rng_states"][world.rank]
    inside = f", step {step_in_epoch} of epoch {epoch}" if step_in_epoch else ""
    log.info(f"Resumed {where} at epoch {epoch}, global step {state.global_step}{inside}")


def weights_finite(model, world=None) -> bool:
    """Whether every parameter and buffer is finite (one device read); every rank's shard under ``--fsdp``."""
    if fsdp.sharded(model):
        return fsdp.weights_finite(model, world)
    flags = [torch.isfinite(t).all() for t in model.state_dict().values() if t.is_floating_point()]
    return bool(torch.stack(flags).all()) if flags else True
