"""One training epoch: schedule, step, log; every optimizer step goes through the accumulation step.

Invariants: the loop only feeds microbatches to the step and reads its result;
the scale, RNG replay, sync and optimizer logic live in the step, so the
built-in trainer and a patched upstream run share one implementation. The
learning rate is set from the global step before each microbatch, as upstream.
The first window of a run checks that every rank has the same microbatch sizes
(the window scale must agree across ranks). An epoch resumed at step S skips
the data of steps < S and restores the random state saved at S, so it trains
exactly as the uninterrupted epoch would have.
"""
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ..errors import UsageError
from ..scales import window_loss_scale
from .preempt import Preempted


@dataclass
class TrainState:
    task: Any
    optimizer: torch.optim.Optimizer
    scaler: Optional[Any]
    scheduler: Callable[[int], float]
    epoch: int = 0
    global_step: int = 0
    samples_seen: int = 0
    step_in_epoch: int = 0  # > 0 only when resuming inside an epoch
    rng_state: Optional[dict] = None  # saved with a mid-epoch checkpoint
    sizes_checked: bool = False


def epoch_seed(seed: int, epoch: int, rank: int) -> int:
    """Per-(epoch, rank) seed for dropout-style randomness, so a resumed epoch draws what it would have."""
    return (seed * 1_000_003 + epoch * 10_007 + rank) % (2 ** 63)


def rng_snapshot() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def rng_restore(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _scalar(x) -> Optional[float]:
    return None if x is None else float(x.detach().float().mean())


def _window_info(losses, report, sizes, tokens, args, world, lr):
    reduced = world.mean({k: v.detach().float() for k, v in losses.items()})
    return {
        "losses": {k: float(v) for k, v in reduced.items()},
        "lr": lr,
        "logit_scale": _scalar(report.get("logit_scale")),
        "logit_bias": _scalar(report.get("logit_bias")),
        "window_scale": window_loss_scale(sizes, args.batch_size, args.naflex_loss_scale),
        "window_samples": sum(sizes),
        "window_samples_global": sum(sizes) * world.world_size,
        "window_tokens_global": world.sum_int(sum(tokens)),
    }


def check_sizes_agree(sizes, world) -> None:
    if not world.all_equal(sizes):
        raise UsageError(
            f"rank {world.rank}: microbatch sizes {sizes} of the first window differ across ranks, so the "
            f"window scale would too; every rank must follow the same (seeded) NaFlex schedule")


def _start_epoch(state, loader, args, world) -> int:
    """Seed, position the data, restore a mid-epoch random state; returns the index of the first batch."""
    start = state.step_in_epoch * args.accum_freq
    torch.manual_seed(epoch_seed(args.seed, state.epoch, world.rank))
    loader.set_epoch(state.epoch, start_batch=start)
    if state.rng_state is not None:
        rng_restore(state.rng_state)
    state.task.train()
    return start


def train_one_epoch(state: TrainState, loader, args, world, device, autocast, step_fn, run_logger,
                    stop=None) -> None:
    task, k = state.task, args.accum_freq
    num_steps = loader.num_batches // k
    start = _start_epoch(state, loader, args, world)
    run_logger.start_epoch(state.epoch, num_steps - state.step_in_epoch)
    accum_state = ([], {}) if k > 1 else None
    sizes, tokens, data_time, samples_in_epoch = [], [], 0.0, 0
    end = time.time()
    for i, batch in enumerate(loader, start=start):
        if i >= num_steps * k:
            break  # a trailing partial window would never step
        step_in_epoch = i // k
        lr = state.scheduler(num_steps * state.epoch + step_in_epoch)
        batch = task.prepare_batch(batch, device)
        data_time += time.time() - end
        sizes.append(task.batch_size(batch))
        tokens.append(int(batch["image"]["patch_valid"].sum()))
        if not state.sizes_checked and len(sizes) == k:
            check_sizes_agree(sizes, world)
            state.sizes_checked = True
        result = step_fn(task, batch, accum_state, state.optimizer, state.scaler, autocast, args)
        if result is None:
            end = time.time()
            continue
        losses, report, step_batch_size, accum_state = result
        state.global_step += 1
        state.samples_seen += step_batch_size * world.world_size
        samples_in_epoch += step_batch_size * world.world_size
        info = _window_info(losses, report, sizes, tokens, args, world, lr)
        info.update(samples=samples_in_epoch, data_time=data_time)
        last = step_in_epoch + 1 == num_steps
        run_logger.step(state.epoch, step_in_epoch + 1, num_steps, state.global_step, info,
                        loader.num_samples, console=(step_in_epoch % args.log_every_n_steps == 0) or last)
        sizes, tokens, data_time = [], [], 0.0
        if stop is not None and not last and stop.requested():
            state.step_in_epoch = step_in_epoch + 1
            run_logger.end_epoch()
            raise Preempted(state.step_in_epoch)
        end = time.time()
    state.step_in_epoch, state.rng_state = 0, None
    run_logger.end_epoch()
