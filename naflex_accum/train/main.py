"""``naflex-accum train``: build model, task, data and optimizer; train, evaluate, checkpoint.

Invariants: a run stopped at any moment and resumed with ``--resume latest`` ends with the weights of an
uninterrupted one; everything is built and checked before the run folder is created or changed; the exit
status says how the run ended (``EXIT_CODES``).
"""
import logging
import shlex
import sys

import torch
from open_clip.tokenizer import SimpleTokenizer
from open_clip_train.precision import get_autocast
from torch.nn.parallel import DistributedDataParallel as DDP

from ..accum.modes import make_step
from ..data import data_index, make_train_loader, make_val_loader, stop_workers
from ..errors import QuietUsageError, UsageError, WriteError, last_word
from ..models import create_model, takes_flat_patches
from ..tasks import create_task
from .config.params import data_config, parse_args
from .ending.distributed import DEFAULT_TIMEOUT, connect, init_distributed
from .ending.exits import EXIT_CODES, EXIT_LOADER, EXIT_NONFINITE, transient
from .ending.preempt import EXIT_STOPPED, Preempted, StopRequest
from .eval.evaluate import evaluate
from .eval.zeroshot import due, make_zero_shot
from .kept.checkpoint import load_checkpoint
from .kept.resume import restore
from .kept.rundir import claim_run, create_run_folder, on_master
from .kept.saver import NonFiniteWeights, Saver
from .loop import Loop, TrainState, train_one_epoch
from .lr import make_scheduler
from .model import fsdp
from .model.compile import compile_model
from .model.finetune import prepare_model
from .monitor import NonFiniteLoss, StepMonitor
from .output.logs import RunLogger, log_file_only, setup_logging
from .output.report import open_wandb, sinks
from .output.summary import finished, log_nothing_to_do, log_summary
from .ending.liveness import Failure

log = logging.getLogger(__name__)

__all__ = ["EXIT_CODES", "main", "train"]


def build_optimizer(model, args):
    """AdamW; no weight decay on gains, biases and the logit parameters, as open_clip."""
    def exclude(name, p):
        return p.ndim < 2 or "bn" in name or "ln" in name or "bias" in name or "logit_scale" in name
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in named if exclude(n, p)], "weight_decay": 0.0},
              {"params": [p for n, p in named if not exclude(n, p)], "weight_decay": args.wd}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(args.beta1, args.beta2), eps=args.eps)


def build_task(args, world, device):
    torch.manual_seed(args.seed)  # same initial weights on every rank and every resume
    try:
        model = create_model(args.model, siglip=args.siglip, patch_dropout=args.force_patch_dropout,
                             patch_sizes=args.naflex_patch_sizes)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    embeds = getattr(getattr(model.visual, "trunk", None), "embeds", None)  # a timm NaFlexVit tower's
    native = tuple(embeds.patch_size)[0] if embeds is not None else None
    if native is not None and len(args.naflex_patch_sizes) == 1 and args.naflex_patch_sizes[0] != native:
        # one size goes to the tower flattened, as its own patch embedding takes it: only its native size fits
        raise UsageError(f"--naflex-patch-sizes {args.naflex_patch_sizes[0]}: --model {args.model} embeds "
                         f"{native}-pixel patches; give {native}, or several sizes (e.g. "
                         f"{args.naflex_patch_sizes[0]} {native}) to resample its patch embedding per batch")
    prepare_model(model, args)  # --pretrained, --lock-*, --grad-checkpointing: before DDP and the optimizer
    model.to(device)
    loss_kwargs = dict(rank=world.rank, world_size=world.world_size)
    if not args.siglip:
        loss_kwargs.update(local_loss=args.local_loss, gather_with_grad=args.gather_with_grad)
    if args.fsdp and world.distributed:
        fsdp.shard(model, world, args)  # in place: the task's trainable module is the sharded model itself
    elif args.fsdp:
        log.warning("--fsdp needs several processes (torchrun); one process trains the model unsharded, "
                    "as upstream does")
    task = create_task(model, siglip=args.siglip, **loss_kwargs)
    if args.torchcompile:  # before DDP, as upstream's 'model' strategy
        compile_model(model, args, world.distributed)  # in place: the task's trainable module is the model
    if world.distributed and not fsdp.sharded(model):
        ids = [device.index] if device.type == "cuda" else None
        # one parameter a bucket: DDP rebuilds its buckets after its first step, in another order, so a resumed
        # start would sum 3+ ranks' gradients in another order than the uninterrupted run (docs/distributed.md)
        task.trainable_module = DDP(task.trainable_module, device_ids=ids, bucket_cap_mb_list=[0])
    return task, model


def eval_task(task, model, args, world, device):
    """The task evaluations run with: under ``--fsdp`` a whole copy of the model on rank 0 (None elsewhere),
    gathered by every rank, since a sharded forward on rank 0 alone would wait for the others."""
    if not fsdp.sharded(model):
        return task
    state = fsdp.full_model_state(model)
    if not world.is_master:
        return None
    whole = create_model(args.model, siglip=args.siglip, patch_sizes=args.naflex_patch_sizes)
    whole.load_state_dict(state)
    return create_task(whole.to(device), siglip=args.siglip)


def build_data(args, world, model, device):
    tokenizer = SimpleTokenizer(context_length=model.context_length)
    cfg = data_config(args, world.rank, world.world_size)
    # the shards and their sizes from rank 0, for every rank: all cut their epochs from the same sizes
    cfg.index = on_master(world, data_index, cfg) if world.distributed else None
    train = make_train_loader(cfg, tokenizer, pin_memory=device.type == "cuda")
    val = None
    if args.val_data and world.is_master:
        val = make_val_loader(args.val_data, tokenizer, seq_len=args.val_seq_len or max(args.naflex_seq_lens),
                              batch_size=args.val_batch_size, patch_size=args.naflex_patch_sizes[0], workers=0,
                              decode=args.image_decode, timeout=args.data_timeout,
                              flatten=takes_flat_patches(args.naflex_patch_sizes))
    return train, val


def select_step(args):
    """A step of ``--accum-mode`` of this run's own (its ``window_scale`` is what the loop logs)."""
    return make_step(args.accum_mode)


def _resume(state, model, claim, args, world) -> None:
    payload = claim.payload if claim.payload is not None else load_checkpoint(claim.resume)
    claim.payload = None  # rank 0 read it while choosing; the tensors are in the model and optimizer now
    restore(state, model, payload, f"--resume {claim.resume}", args, world)


def _nonfinite_message(step: int, num_steps: int, saver: Saver) -> str:
    epoch, in_epoch = (step - 1) // num_steps, (step - 1) % num_steps + 1
    advice = "a lower --lr, a --grad-clip-norm or another --precision"
    then = f"last good checkpoint: {saver.last_good}; resume it with --resume and {advice}" if saver.last_good \
        else f"last good checkpoint: none (this run saved nothing yet); start again with {advice}"
    return (f"Non-finite loss at optimizer step {step} (epoch {epoch}, step {in_epoch}/{num_steps}): stopped "
            f"without saving; {then} (exit {EXIT_NONFINITE})")


def _master_only(world, fn, *args):
    """``fn(*args)`` on rank 0 (None elsewhere); the others wait on the store and share its ``UsageError``."""
    kept = {}
    on_master(world, lambda: kept.update(value=fn(*args)))
    return kept.get("value")


def _wandb_run(args, world, paths):
    """Rank 0's wandb run when ``--report-to`` names wandb (every rank takes part in the outcome)."""
    if "wandb" not in sinks(args.report_to):
        return None
    return _master_only(world, open_wandb, args, paths.root)


def _evals(args, world, device, task, model, val_data, zero_shot, autocast, run_logger, state):
    """``run_evals(epoch)``: rank 0 evaluates alone while the others wait on the store (not in a collective,
    which would time out on a long evaluation); every rank gets the metrics."""
    def on_rank0(evaluating, epoch: int) -> dict:
        metrics = {}  # zero-shot first, then retrieval: the key order of open_clip's evaluate (results.jsonl)
        if zero_shot is not None:
            metrics.update(zero_shot(evaluating, epoch, autocast))
        if val_data is not None and due(epoch, args.val_frequency, args.epochs):
            metrics.update(evaluate(evaluating, val_data, device, autocast, epoch))
        return metrics

    def run_evals(epoch: int) -> dict:
        wanted = (val_data is not None and due(epoch, args.val_frequency, args.epochs)) or \
            (zero_shot is not None and zero_shot.due(epoch))  # known on rank 0, which evaluates
        if fsdp.sharded(model):  # every rank joins the gather of the whole model, only when an eval is due
            wanted = world.broadcast_object(wanted)
        evaluating = eval_task(task, model, args, world, device) if wanted else None
        metrics = on_master(world, on_rank0, evaluating, epoch)
        run_logger.eval(epoch, metrics, state.global_step)
        return metrics
    return run_evals


def _log_error(line: str, file_only: bool = False) -> None:
    try:
        (log_file_only if file_only else log.error)(line)
    except WriteError:  # out.log's storage is gone too: its handler has left; the console's (the first) has the line
        pass


def _again(args) -> str:
    """The flags that continue this run folder (a dated default name must be named: params.validate)."""
    return f"--resume latest --name {shlex.quote(args.name)}"


def _after_failure(state, saver, args) -> str:
    """What a failure line says about the run (``liveness``: every rank's line names the same checkpoint)."""
    return (f"the run stopped after optimizer step {state.global_step} without saving; last good checkpoint: "
            f"{saver.last_good or 'none'}; run again with {_again(args)}")


def run(args, world, device, ends_process: bool = False) -> dict:
    """One run in this process; ``ends_process``: the process ends with it (``preempt.StopRequest``)."""
    setup_logging(None, world.is_master)
    claim = claim_run(args, world)
    if world.peers is not None:
        world.peers.context = lambda: (f"nothing was trained; last checkpoint: {claim.resume or 'none'}; run it "
                                       f"again" + (f" with {_again(args)}" if claim.resume else ""))
    try:
        return _run(args, world, device, claim, ends_process)
    except UsageError as exc:
        if world.is_master and isinstance(exc, WriteError):  # a full disk: main says it on stderr, out.log too
            _log_error(str(exc), file_only=True)
        claim.discard()  # a refused start leaves no folder it made, unless it trained a step or saved there
        raise
    finally:
        claim.release()


def _run(args, world, device, claim, ends_process: bool) -> dict:
    paths = claim.paths
    task, model = build_task(args, world, device)
    train_data, val_data = build_data(args, world, model, device)
    optimizer = build_optimizer(model, args)
    scaler = torch.amp.GradScaler(device.type) if args.precision == "amp" else None
    num_steps = train_data.num_batches // args.accum_freq
    state = TrainState(task, optimizer, scaler, scheduler=None, lr_steps_per_epoch=num_steps,
                       data_listing=train_data.index.listing())
    if claim.resume is not None:
        _resume(state, model, claim, args, world)
        if finished(state, args):  # before the run folder is touched: nothing in it changes
            return log_nothing_to_do(claim.resume, state, args, str(paths.root))
    claim.watch(state)
    # laid out once for the run: a resume at another world size keeps the saved steps per epoch (loop.lr_position)
    state.scheduler = make_scheduler(optimizer, args.lr, args.warmup, state.lr_steps_per_epoch * args.epochs,
                                     args.lr_scheduler)
    create_run_folder(claim, args, world)  # everything above is checked: only now is the folder made or changed
    stop = StopRequest(paths.stop_file, world, ends_process)
    stop.clear()
    saver = Saver(paths, args, world, model, last_good=claim.resume)
    if world.peers is not None:
        world.peers.context = lambda: _after_failure(state, saver, args)
    run_logger = RunLogger(log, world.is_master, paths.tensorboard if "tensorboard" in sinks(args.report_to)
                           else None, _wandb_run(args, world, paths), results_file=paths.results)
    autocast, metrics, exit_code = get_autocast(args.precision, device.type), {}, 0
    if world.peers is not None:
        world.peers.flushers.append(run_logger.flush)
    loop = Loop(args, world, device, autocast, select_step(args), run_logger, stop, StepMonitor(device, world), saver)
    log.info(f"Run folder {paths.root}: {num_steps} steps/epoch, {train_data.num_samples} samples/epoch, "
             f"world size {world.world_size}" + (f", resumed from {claim.resume}" if claim.resume else ""))
    for note in getattr(args, "notes", ()):
        log.info(note)
    log.info(train_data.describe())
    zero_shot = _master_only(world, make_zero_shot, args, model, world, device)
    run_evals = _evals(args, world, device, task, model, val_data, zero_shot, autocast, run_logger, state)
    try:
        if args.val_at_start and state.epoch == 0 and state.global_step == 0:
            metrics = run_evals(0)
        for _ in range(state.epoch, args.epochs):
            train_one_epoch(state, train_data, loop)
            state.epoch += 1
            metrics = run_evals(state.epoch) or metrics
            saver.save_epoch(state)
        log_summary(state, args, run_logger, saver.last_good)
    except Preempted:
        saved, exit_code, reason = saver.save_stop(state), EXIT_STOPPED, stop.reason()
        stop.served()  # answered: the next start must not meet this STOP file
        log.info(last_word(f"Stopped on request ({reason}) after step {state.step_in_epoch} of epoch "
                           f"{state.epoch}: saved {saved}; continue with {_again(args)} (exit {EXIT_STOPPED})"))
    except (NonFiniteLoss, NonFiniteWeights) as exc:
        step = exc.global_step if isinstance(exc, NonFiniteLoss) else state.global_step
        exit_code, line = EXIT_NONFINITE, last_word(_nonfinite_message(step, num_steps, saver))
        if world.is_master:
            log.error(line)
    except Exception as exc:
        what = transient(exc)
        if what is None:
            raise
        exit_code = EXIT_LOADER
        which = "Writing the run folder" if isinstance(exc, WriteError) else "Data loader"
        line = last_word(f"{which} failed on rank {world.rank}: {what}. The run stopped after optimizer step "
                         f"{state.global_step} without saving; last good checkpoint: {saver.last_good or 'none'}; "
                         f"run again with {_again(args)} (exit {EXIT_LOADER})")
        if world.is_master:
            _log_error(line)
        if world.distributed:  # every rank ends with it; rank 0 prints another rank's (liveness)
            raise Failure(world.rank, EXIT_LOADER, line) from None
    finally:
        stop_workers()  # a worker that outlived a failure would hold the process at exit (workers ignore SIGTERM)
        stop.close()
        run_logger.close()
    return {"run_folder": str(paths.root), "metrics": metrics, "epoch": state.epoch,
            "preempted": exit_code == EXIT_STOPPED, "exit_code": exit_code, "last_checkpoint": saver.last_good,
            "global_step": state.global_step, "corrupt": train_data.stats.get("corrupt", 0),
            "first_loss": run_logger.first_loss, "epoch_losses": run_logger.epoch_losses,
            "evals": run_logger.evals, "val_samples": getattr(val_data, "num_samples", 0)}


def train(argv=None, prog="naflex-accum train", ends_process: bool = False) -> dict:
    """Parse, set up the process group, run, tear down; run()'s summary (rank 0's is complete). With several
    processes every rank ends in the first failure's class (``liveness``): ``QuietUsageError`` or ``Failure``
    where it was printed elsewhere. ``ends_process``: see ``preempt``."""
    try:
        args, bad = parse_args(argv, prog), None
    except UsageError as exc:  # every rank has it: heard through the job's store like any failure (rank 0 says it)
        args, bad = None, exc
    world = connect(timeout=args.dist_timeout if args else DEFAULT_TIMEOUT, prog=prog, ends_process=ends_process)
    code = None
    try:
        if bad is not None:
            raise bad
        world, device = init_distributed(args.device, world=world)
        check_same_flags(args, world)
        result = run(args, world, device, ends_process)
        code = result["exit_code"]
    except (Exception, KeyboardInterrupt) as exc:
        if world.peers is None:
            raise
        world.peers.end_with(exc)
    finally:
        world.close(code)
    result.update(is_master=world.is_master, report_to=args.report_to)
    return result


def check_same_flags(args, world) -> None:
    """Every rank runs rank 0's flags (``--device`` aside): one that differs would make the ranks' collectives
    disagree, or train its share of the batch otherwise. Each rank sees every rank's, so all refuse alike."""
    flags = world.gather_object({k: repr(v) for k, v in vars(args).items() if k != "device"})
    for rank, theirs in enumerate(flags[1:], start=1):
        differ = [f"--{k.replace('_', '-')} {v} (rank 0: {flags[0].get(k)})" for k, v in theirs.items()
                  if v != flags[0].get(k)]
        if differ:
            raise UsageError(f"rank {rank}'s flags differ from rank 0's: {', '.join(differ)}; launch every rank "
                             f"with the same flags")


def print_footer(result: dict) -> None:
    if not result["is_master"]:
        return
    print(f"Run folder: {result['run_folder']}")
    if "tensorboard" in sinks(result["report_to"]):
        print(f"Tensorboard: tensorboard --logdir {result['run_folder']}/tensorboard")
    if "wandb" in sinks(result["report_to"]):
        folder = f"{result['run_folder']}/wandb"
        print(f"wandb: {folder} (offline runs: wandb sync {folder}/offline-run-*)")


def main(argv=None, prog="naflex-accum train", ends_process: bool = False) -> int:
    """The exit status is one of ``EXIT_CODES``; rank 0 alone prints an error every rank shares."""
    try:
        result = train(argv, prog, ends_process)
    except UsageError as exc:  # one line, not an error for torchrun's summary (``commands.train``)
        line = last_word(f"{prog}: error: {exc}")
        if not isinstance(exc, QuietUsageError):  # rank 0 prints that
            print(line, file=sys.stderr)
        return exc.exit_code
    except Failure as ended:  # its line was printed where it had to be
        return ended.code
    except Exception as exc:  # one process, before the run proper (counting the shards, making its folder) or after
        what = transient(exc)
        if what is None:
            raise
        print(last_word(f"{prog}: error: {what}; run it again (exit {EXIT_LOADER})"), file=sys.stderr)
        return EXIT_LOADER
    print_footer(result)
    return result["exit_code"]
