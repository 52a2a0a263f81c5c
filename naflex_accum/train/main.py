"""``naflex-accum train``: build model, task, data and optimizer; train, evaluate, checkpoint.

Invariant: a run is a pure function of its flags and seed: a run stopped after
epoch K and resumed with ``--resume latest`` ends with the weights of an
uninterrupted one (model, optimizer, scaler, counters and the per-epoch data
order and random state are all restored or re-derived).
"""
import logging
from contextlib import nullcontext
from functools import partial

import torch

from ..errors import UsageError
from .checkpoint import load_checkpoint, resolve_run, save_checkpoint
from .distributed import init_distributed
from .evaluate import evaluate
from .finetune import data_options, prepare_model
from .logs import LOGGER_NAME, RunLogger, setup_logging, write_params
from .loop import TrainState, rng_snapshot, train_one_epoch
from .lr import make_scheduler
from .params import parse_args
from .preempt import Preempted, StopRequest
from .zeroshot import due, make_zero_shot

log = logging.getLogger(LOGGER_NAME)


def get_autocast(precision: str, device: torch.device):
    if precision == "fp32":
        return nullcontext
    dtype = torch.bfloat16 if precision == "amp_bf16" else torch.float16
    return partial(torch.autocast, device_type=device.type, dtype=dtype)


def build_optimizer(model, args):
    """AdamW; no weight decay on gains, biases and the logit parameters, as open_clip."""
    def exclude(name, p):
        return p.ndim < 2 or "bn" in name or "ln" in name or "bias" in name or "logit_scale" in name
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in named if exclude(n, p)], "weight_decay": 0.0},
              {"params": [p for n, p in named if not exclude(n, p)], "weight_decay": args.wd}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(args.beta1, args.beta2), eps=args.eps)


def build_task(args, world, device):
    from ..models import create_model, enable_patch_sizes
    from ..tasks import create_task

    torch.manual_seed(args.seed)  # same initial weights on every rank and every resume
    try:
        model = create_model(args.model, siglip=args.siglip, patch_dropout=args.force_patch_dropout)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if len(args.naflex_patch_sizes) > 1:
        enable_patch_sizes(model)
    prepare_model(model, args)  # --pretrained, --lock-*, --grad-checkpointing: before DDP and the optimizer
    model.to(device)
    loss_kwargs = dict(rank=world.rank, world_size=world.world_size)
    if not args.siglip:
        loss_kwargs.update(local_loss=args.local_loss, gather_with_grad=args.gather_with_grad)
    task = create_task(model, siglip=args.siglip, **loss_kwargs)
    if world.distributed:
        from torch.nn.parallel import DistributedDataParallel as DDP
        ids = [device.index] if device.type == "cuda" else None
        task.trainable_module = DDP(model, device_ids=ids)
    return task, model


def build_data(args, world, model):
    from open_clip.tokenizer import SimpleTokenizer

    from ..data import DataConfig, make_train_loader, make_val_loader

    tokenizer = SimpleTokenizer(context_length=model.context_length)
    cfg = DataConfig(
        train_data=args.train_data, seq_lens=tuple(args.naflex_seq_lens),
        seq_len_probs=tuple(args.naflex_seq_len_probs) if args.naflex_seq_len_probs else None,
        max_tokens_per_batch=args.naflex_max_tokens_per_batch, batch_divisor=args.naflex_batch_divisor,
        patch_sizes=tuple(args.naflex_patch_sizes), num_samples=args.train_num_samples,
        num_image_tokens=args.naflex_num_train_image_tokens, accum_freq=args.accum_freq,
        seed=args.seed, workers=args.workers, rank=world.rank, world_size=world.world_size, **data_options(args))
    train = make_train_loader(cfg, tokenizer)
    val = None
    if args.val_data and world.is_master:
        val = make_val_loader(args.val_data, tokenizer, seq_len=args.val_seq_len or max(args.naflex_seq_lens),
                              batch_size=args.val_batch_size, patch_size=args.naflex_patch_sizes[0], workers=0)
    return train, val


def select_step(args):
    from ..modes import get_step
    return get_step(args.accum_mode)


def restore(state: TrainState, model, path, world) -> None:
    ckpt = load_checkpoint(path)
    state_dict = {k.removeprefix("module."): v for k, v in ckpt["state_dict"].items()}
    model.load_state_dict(state_dict)
    state.optimizer.load_state_dict(ckpt["optimizer"])
    if state.scaler is not None and ckpt.get("scaler") is not None:
        state.scaler.load_state_dict(ckpt["scaler"])
    state.epoch = int(ckpt["epoch"])
    state.global_step = int(ckpt.get("global_step", 0))
    state.samples_seen = int(ckpt.get("samples_seen", 0))
    state.step_in_epoch = int(ckpt.get("step_in_epoch", 0))
    rng_states = ckpt.get("rng_states")
    if state.step_in_epoch and rng_states:
        if len(rng_states) != world.world_size:
            raise UsageError(f"--resume {path}: saved inside an epoch by {len(rng_states)} ranks; resume it with "
                             f"the same world size, or from an epoch_K.pt checkpoint")
        state.rng_state = rng_states[world.rank]
    where = f", step {state.step_in_epoch} of epoch {state.epoch}" if state.step_in_epoch else ""
    log.info(f"Resumed {path} at epoch {state.epoch}, global step {state.global_step}{where}")


def checkpoint_payload(state: TrainState, model, args, rng_states=None) -> dict:
    payload = {"epoch": state.epoch, "global_step": state.global_step, "samples_seen": state.samples_seen,
               "name": args.name, "state_dict": model.state_dict(), "optimizer": state.optimizer.state_dict(),
               "scaler": state.scaler.state_dict() if state.scaler is not None else None}
    if rng_states is not None:  # inside an epoch: where to continue, and each rank's random state there
        payload.update(step_in_epoch=state.step_in_epoch, rng_states=rng_states)
    return payload


def save_mid_epoch(state, model, args, world, paths) -> None:
    """Every rank's random state goes to rank 0, which writes epoch_latest.pt."""
    rng_states = world.gather_object(rng_snapshot())
    if world.is_master:
        save_checkpoint(paths.mid_epoch, checkpoint_payload(state, model, args, rng_states))
        log.info(f"Stop requested: saved {paths.mid_epoch} at step {state.step_in_epoch} of epoch {state.epoch}; "
                 f"continue with --resume latest")


def end_of_epoch(state, model, args, world, paths) -> None:
    save = args.save_frequency and (state.epoch % args.save_frequency == 0 or state.epoch == args.epochs)
    if world.is_master and save:
        save_checkpoint(paths.checkpoint(state.epoch), checkpoint_payload(state, model, args))
    if world.is_master:
        paths.mid_epoch.unlink(missing_ok=True)  # superseded by this epoch's state


def prepare_folder(paths, resume, args, world) -> None:
    if not world.is_master:
        return
    paths.root.mkdir(parents=True, exist_ok=True)
    paths.checkpoints.mkdir(exist_ok=True)
    params = paths.params_file if not paths.params_file.exists() else \
        paths.root / f"params-resume-{resume.stem if resume else 'fresh'}.txt"
    write_params(params, args)


def run(args, world, device) -> dict:
    paths, resume = resolve_run(args)
    if world.distributed:
        torch.distributed.barrier()  # every rank has checked the folder before rank 0 creates it
    prepare_folder(paths, resume, args, world)
    setup_logging(paths.log_file if world.is_master else None, world.is_master)
    task, model = build_task(args, world, device)
    train_data, val_data = build_data(args, world, model)
    optimizer = build_optimizer(model, args)
    scaler = torch.amp.GradScaler(device.type) if args.precision == "amp" else None
    total_steps = (train_data.num_batches // args.accum_freq) * args.epochs
    state = TrainState(task, optimizer, scaler, make_scheduler(optimizer, args.lr, args.warmup, total_steps,
                                                               args.lr_scheduler))
    if resume is not None:
        restore(state, model, resume, world)
    stop = StopRequest(paths.stop_file, world)
    stop.clear()
    tb = paths.tensorboard if args.report_to == "tensorboard" else None
    run_logger = RunLogger(log, world.is_master, tb)
    autocast, step_fn, metrics = get_autocast(args.precision, device), select_step(args), {}
    log.info(f"Run folder {paths.root}: {train_data.num_batches // args.accum_freq} steps/epoch, "
             f"{train_data.num_samples} samples/epoch, world size {world.world_size}")
    zero_shot = make_zero_shot(args, model, world, device)

    def run_evals(epoch: int) -> dict:
        metrics = {}
        if val_data is not None and due(epoch, args.val_frequency, args.epochs):
            metrics.update(evaluate(task, val_data, device, autocast))
        if zero_shot is not None:
            metrics.update(zero_shot(task, epoch, autocast))
        run_logger.eval(epoch, metrics, state.global_step)
        return metrics

    if args.val_at_start and state.epoch == 0:
        metrics = run_evals(0)
    preempted = False
    try:
        for _ in range(state.epoch, args.epochs):
            train_one_epoch(state, train_data, args, world, device, autocast, step_fn, run_logger, stop)
            state.epoch += 1
            metrics = run_evals(state.epoch) or metrics
            end_of_epoch(state, model, args, world, paths)
    except Preempted:
        save_mid_epoch(state, model, args, world, paths)
        preempted = True
    finally:
        run_logger.close()
    return {"run_folder": str(paths.root), "metrics": metrics, "epoch": state.epoch, "preempted": preempted,
            "global_step": state.global_step, "corrupt": train_data.stats.get("corrupt", 0),
            "first_loss": run_logger.first_loss, "epoch_losses": run_logger.epoch_losses,
            "evals": run_logger.evals, "val_samples": getattr(val_data, "num_samples", 0)}


def train(argv=None, prog="naflex-accum train") -> dict:
    """Parse, set up the process group, run, tear down; returns run()'s summary (rank 0's is complete)."""
    args = parse_args(argv, prog)
    world, device = init_distributed(args.device)
    try:
        result = run(args, world, device)
    finally:
        if world.distributed and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    result.update(is_master=world.is_master, report_to=args.report_to)
    return result


def print_footer(result: dict) -> None:
    if not result["is_master"]:
        return
    print(f"Run folder: {result['run_folder']}")
    if result["report_to"] == "tensorboard":
        print(f"Tensorboard: tensorboard --logdir {result['run_folder']}/tensorboard")


def main(argv=None, prog="naflex-accum train") -> int:
    print_footer(train(argv, prog))
    return 0
