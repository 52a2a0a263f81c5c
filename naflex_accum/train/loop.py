"""One training epoch: schedule, step, check, log, save; every optimizer step goes through the accumulation step.

Invariants: the loop only feeds microbatches to the step and reads its result (so the trainer and a patched
upstream run share one implementation); it reads the device at most once per optimizer step (``monitor``);
the first window checks that every rank has the same microbatch sizes; a resumed epoch trains as the
uninterrupted one would (docs/long-runs.md, "Resuming" and "Elastic resume").
"""
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ..accum.rng import RngState
from ..data import Segment
from ..errors import UsageError
from .ending.preempt import Preempted
from .model.compile import mark_batch_dynamic

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    task: Any
    optimizer: torch.optim.Optimizer
    scaler: Optional[Any]
    scheduler: Callable[[int], float]
    epoch: int = 0
    global_step: int = 0
    samples_seen: int = 0
    step_in_epoch: int = 0  # where the current epoch starts (a resume), and the position a mid-epoch save records
    rng_state: Optional[dict] = None  # this rank's, from a mid-epoch checkpoint
    sizes_checked: bool = False
    segment: Optional[Segment] = None  # the part of the epoch being run (data.order); from a resume, the saved one
    epoch_samples: int = 0  # global samples (and token slots) the epoch consumed so far
    epoch_tokens: int = 0
    lr_steps_per_epoch: int = 0  # the steps per epoch the learning-rate schedule was laid out with
    meters: Optional[dict] = None  # the epoch's loss meters (logs.RunLogger.meter_state) at a mid-epoch save
    data_listing: Optional[list] = None  # the training shards and their sizes (slots.DataIndex.listing)


@dataclass
class Loop:
    """What every step of the loop uses besides the state."""
    args: Any
    world: Any
    device: torch.device
    autocast: Callable
    step_fn: Callable
    logger: Any   # logs.RunLogger
    stop: Any     # preempt.StopRequest
    monitor: Any  # monitor.StepMonitor
    saver: Any    # saver.Saver


def epoch_seed(seed: int, epoch: int, rank: int, base: int = 0) -> int:
    """Per-(epoch, rank) seed, so a resumed epoch draws what it would have; a segment after a world-size
    change (``base`` > 0) gets its own (the saved ranks' streams do not map onto the new ranks)."""
    return (seed * 1_000_003 + epoch * 10_007 + rank + base * 7_919_111) % (2 ** 63)


def lr_position(state, segment: Segment, step: int, k: int) -> float:
    """Segment step ``step`` in the schedule's own steps: the segment's starting fraction of the epoch plus its
    share of the rest (at one world size, the step itself)."""
    ref, steps = state.lr_steps_per_epoch, max(1, segment.num_batches // k)
    if segment.progress == 0.0 and ref == steps:
        return ref * state.epoch + step
    return ref * (state.epoch + segment.progress + (1.0 - segment.progress) * step / steps)


def check_sizes_agree(sizes, world) -> None:
    if not world.all_equal(sizes):
        raise UsageError(
            f"microbatch sizes {sizes} of the first window differ across ranks, so the "
            f"window scale would too; every rank must follow the same (seeded) NaFlex schedule")


def _position(state, loader, k: int) -> int:
    """Put the loader at the state's place in the epoch; returns the segment's first batch to run."""
    saved = state.segment
    if saved is None or saved.epoch != state.epoch:
        loader.set_epoch(state.epoch)
        state.segment = loader.segment
        return 0
    if saved.world_size != loader.cfg.world_size:  # elastic: the rest of the epoch at this world size
        state.segment = loader.resized(saved, state.step_in_epoch, state.epoch_samples, state.epoch_tokens)
        state.rng_state = None
        loader.set_epoch(state.epoch, 0, state.segment)
        log.info(f"Epoch {state.epoch} goes on at world size {loader.cfg.world_size} (saved at "
                 f"{saved.world_size}) from global sample {state.segment.base}: "
                 f"{state.segment.num_batches // k} more steps; dropout streams reseeded for the new ranks")
        return 0
    start = (state.step_in_epoch - saved.first_step) * k
    loader.set_epoch(state.epoch, start, saved)
    return start


def _start_epoch(state, loader, args, world):
    """Seed, position the data, restore a mid-epoch random state; returns the ``(batch, meta)`` iterator."""
    start = _position(state, loader, args.accum_freq)
    torch.manual_seed(epoch_seed(args.seed, state.epoch, world.rank, state.segment.base))
    batches = loader.iter_meta()
    # A DataLoader draws its workers' base seed from the global generator when its iterator starts: keep
    # that draw out of the stream the model sees, wherever in the epoch the iterator starts.
    with torch.random.fork_rng(devices=[]):
        first = next(batches, None)
    if state.rng_state is not None:
        RngState.from_dict(state.rng_state).restore()
    state.task.train()
    return start, (batches if first is None else itertools.chain([first], batches))


def train_one_epoch(state: TrainState, loader, loop: Loop) -> None:
    args, world, task, k = loop.args, loop.world, state.task, loop.args.accum_freq
    start, batches = _start_epoch(state, loader, args, world)
    segment, specs = state.segment, loader.schedule()
    seg_steps = segment.num_batches // k
    num_steps = segment.first_step + seg_steps
    state.epoch_samples = segment.base + sum(spec.batch_size for spec in specs[:start]) * world.world_size
    # the epoch's samples as this segment ends it (another world size's resume ends it with its own schedule)
    epoch_total = segment.base + world.world_size * sum(spec.batch_size for spec in specs)
    state.epoch_tokens = segment.base_tokens + world.world_size * sum(s.batch_size * s.seq_len for s in specs[:start])
    loop.logger.start_epoch(state.epoch, num_steps - state.step_in_epoch, state.meters)
    state.meters = None
    accum_state = ([], {}) if k > 1 else None
    sizes, tokens, data_time = [], 0, 0.0
    end = time.time()
    for batch, meta in batches:
        i = meta["index"]
        if i >= seg_steps * k:
            break  # a trailing partial window would never step
        lr = state.scheduler(lr_position(state, segment, i // k, k))
        batch = task.prepare_batch(batch, loop.device)
        if getattr(args, "torchcompile", False):
            mark_batch_dynamic(batch)
        data_time += time.time() - end
        sizes.append(meta["samples"])
        tokens += meta["image_tokens"]
        state.epoch_tokens += specs[i].batch_size * specs[i].seq_len * world.world_size
        if not state.sizes_checked and len(sizes) == k:
            check_sizes_agree(sizes, world)
            state.sizes_checked = True
        result = loop.step_fn(task, batch, accum_state, state.optimizer, state.scaler, loop.autocast, args)
        if result is not None:
            losses, report, step_batch_size, accum_state = result
            state.global_step += 1
            if not world.started:  # start-up is over: a collective waits --dist-timeout from here on
                world.first_step_done()
            state.samples_seen += step_batch_size * world.world_size
            state.epoch_samples += step_batch_size * world.world_size
            loop.monitor.add(state.global_step, losses, report, sum(sizes), tokens, data_time)
            after_step(state, loop, segment.first_step + i // k + 1, num_steps, lr, state.epoch_samples, epoch_total)
            sizes, tokens, data_time = [], 0, 0.0
        end = time.time()
    state.step_in_epoch, state.rng_state = 0, None
    loop.logger.end_epoch(state.global_step)


def after_step(state, loop: Loop, done: int, num_steps: int, lr, epoch_samples, samples_per_epoch):
    """After step ``done`` of the epoch: check (on the steps every rank agrees on), log, stop or save."""
    args, world = loop.args, loop.world
    if world.peers is not None:
        world.peers.check()
    last = done == num_steps
    log_now = (done - 1) % args.log_every_n_steps == 0 or last
    save_now = loop.saver.step_due(state.global_step)
    due = state.global_step % args.check_every_n_steps == 0
    signalled = not world.distributed and loop.stop.signalled is not None  # free to honour at once in one process
    if not (log_now or save_now or due or signalled):  # log_now includes the epoch's last step
        return
    check = loop.monitor.check(loop.stop.pending())
    if check.steps:
        info = dict(check.info, lr=lr, epoch_samples=epoch_samples, window_scale=loop.step_fn.window_scale)
        loop.logger.step(state.epoch, done, num_steps, state.global_step, info, samples_per_epoch, log_now)
    if check.stop or save_now:
        state.step_in_epoch, state.meters = done, loop.logger.meter_state()
    if check.stop:
        loop.logger.end_epoch(complete=False)
        raise Preempted(done)
    if save_now:
        loop.saver.save_step(state)
        state.meters = None
