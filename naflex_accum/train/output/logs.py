"""Console, ``out.log``, tensorboard and wandb logging of a run, on rank 0 only.

Invariants: only rank 0 writes; out.log holds every line rank 0 logged, those from before its run folder
existed too; the console line keeps open_clip's shape, and no line shares one with the progress bar; epoch
averages cover every step without a device read per step; an unwritable file stops the run with one line
naming it. Scalars keep upstream's names and steps. docs/training.md, "Metrics".
"""
import json
import logging
import logging.handlers
import sys
import threading
from typing import Dict, Optional

from open_clip_train.train import AverageMeter
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from ...errors import WriteError, writing

LOGGER_NAME = "naflex_accum"


class _FileHandler(logging.FileHandler):
    """``out.log``: a failed write raises ``WriteError`` (and the handler leaves) instead of printing a traceback."""

    def handleError(self, record):
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):
            logging.getLogger(LOGGER_NAME).removeHandler(self)
            raise WriteError(self.baseFilename, exc) from None
        super().handleError(record)


class _ConsoleHandler(logging.StreamHandler):
    """The console, through ``tqdm.write``: the progress bar is redrawn below, never sharing a line with a record."""

    def emit(self, record):
        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:
            self.handleError(record)


def setup_logging(log_file=None, is_master: bool = True) -> logging.Logger:
    logger = logging.getLogger(LOGGER_NAME)
    early = [h for h in logger.handlers if isinstance(h, logging.handlers.MemoryHandler)]
    logger.handlers.clear()
    logger.propagate = False
    logger.setLevel(logging.INFO if is_master else logging.WARNING)
    fmt = logging.Formatter("%(asctime)s | %(levelname)s | %(message)s", datefmt="%Y-%m-%d,%H:%M:%S")
    console = _ConsoleHandler(sys.stdout)
    console.setFormatter(fmt)
    logger.addHandler(console)
    if log_file is not None and is_master:
        with writing(log_file):
            append_line(log_file)
            handler = _FileHandler(log_file, mode="a")
        handler.setFormatter(fmt)
        logger.addHandler(handler)
        for buffered in early:  # what the console showed before the folder existed (the model, compile, resume)
            buffered.setTarget(handler)
            buffered.flush()
    elif is_master:  # held for out.log, never flushed before it has a target
        logger.addHandler(logging.handlers.MemoryHandler(capacity=1000, flushLevel=logging.CRITICAL + 1))
    return logger


def append_line(path, text: str = "") -> None:
    """``text`` at the end of ``path``, after the newline that a line cut off by a full disk lacks."""
    with open(path, "ab+") as f:
        cut = f.tell() > 0 and (f.seek(-1, 2), f.read(1))[1] != b"\n"
        f.write(b"\n" * cut + text.encode())


class Meter(AverageMeter):
    """open_clip's ``AverageMeter``, also fed sums: the loop reads losses only on logging steps."""

    def add(self, total: float, n: int, last: float):
        """``n`` more samples whose values sum to ``total``; ``last`` is the newest value."""
        self.val, self.sum, self.count = last, self.sum + total, self.count + n
        self.avg = self.sum / max(1, self.count)


class RunLogger:
    """Step and eval metrics to the console, out.log and (optionally) tensorboard and a wandb run."""

    def __init__(self, logger: logging.Logger, is_master: bool, tensorboard_dir=None, wandb_run=None,
                 results_file=None):
        self.log, self.is_master, self.writer, self.wandb = logger, is_master, None, wandb_run
        self.results_file = results_file if is_master else None
        if is_master and tensorboard_dir is not None:
            self.hook = threading.excepthook  # its writer thread's error: raised again by its next call, one line
            threading.excepthook = lambda a: None if type(a.thread).__name__ == "_AsyncWriterThread" else self.hook(a)
            try:
                with writing(tensorboard_dir):
                    self.writer = SummaryWriter(log_dir=str(tensorboard_dir))
            except BaseException:
                threading.excepthook = self.hook
                raise
        self.loss_meters: Dict[str, Meter] = {}
        self.first_loss: Optional[float] = None
        self.epoch_losses: list = []  # average training loss of each finished epoch
        self.evals: list = []  # (epoch, metrics) of each evaluation
        self.epoch, self.bar = 0, None

    def start_epoch(self, epoch: int, num_steps: int, meters: Optional[dict] = None):
        """``meters``: what ``meter_state`` saved inside this epoch (a resume), so its averages cover it whole."""
        self.epoch, self.loss_meters = epoch, {}
        for key, (total, count, last) in (meters or {}).items():
            self.loss_meters.setdefault(key, Meter()).add(total, count, last)
        if self.is_master and sys.stdout.isatty():
            self.bar = tqdm(total=num_steps, desc=f"epoch {epoch}", leave=False, dynamic_ncols=True, file=sys.stdout)

    def step(self, epoch: int, step_in_epoch: int, num_steps: int, global_step: int, info: dict,
             samples_per_epoch: int, console: bool):
        """What the loop gathered over ``info["steps"]`` optimizer steps ending at ``global_step`` (``losses``:
        each term at this step, mean over ranks; ``loss_sums``: each term times the window's samples, summed)."""
        if not self.is_master:
            return
        if self.first_loss is None:
            self.first_loss = info["losses"]["loss"]
        for key, value in info["losses"].items():
            self.loss_meters.setdefault(key, Meter()).add(info["loss_sums"][key], info["samples"], value)
        elapsed = max(info["elapsed"], 1e-9)
        batch_time, sps, tps = elapsed / info["steps"], info["samples_global"] / elapsed, \
            info["tokens_global"] / elapsed
        if self.bar is not None:
            self.bar.update(info["steps"])
            self.bar.set_postfix(loss=f"{info['losses']['loss']:.4f}", lr=f"{info['lr']:.2e}")
        if not console:
            return
        self._scalars("train", train_scalars(info, elapsed), global_step - 1)
        self._console_line(epoch, step_in_epoch, num_steps, info, samples_per_epoch, batch_time, sps, tps)

    def meter_state(self) -> dict:
        """``{term: [sum, count, last]}`` of the epoch's loss meters so far (rank 0's; {} elsewhere)."""
        return {key: [m.sum, m.count, m.val] for key, m in self.loss_meters.items()}

    def _scalars(self, prefix: str, scalars: dict, step: int, wandb_step: Optional[int] = None):
        """``prefix/name`` scalars at ``step``; in wandb at ``wandb_step`` when given."""
        if self.wandb is not None:
            self.wandb.log({f"{prefix}/{key}": value for key, value in scalars.items()},
                           step=step if wandb_step is None else wandb_step)
        if self.writer is None:
            return
        with writing(self.writer.log_dir):
            for key, value in scalars.items():
                self.writer.add_scalar(f"{prefix}/{key}", value, step)

    def _console_line(self, epoch, step_in_epoch, num_steps, info, samples_per_epoch, batch_time, sps, tps):
        done, digits = info["epoch_samples"], len(str(samples_per_epoch))
        losses = " ".join(f"{k.capitalize()}: {m.val:#.5g} ({m.avg:#.5g})" for k, m in self.loss_meters.items())
        self.log.info(
            f"Train Epoch: {epoch} [{done:>{digits}}/{samples_per_epoch} "
            f"({100.0 * step_in_epoch / num_steps:.0f}%)] Step: {step_in_epoch}/{num_steps} "
            f"Data (t): {info['data_time']:.3f} Batch (t): {batch_time:.3f}, {sps:#g}/s, {tps:#g} tok/s "
            f"LR: {info['lr']:5f} Logit Scale: {info['logit_scale']:.3f} {losses}")

    def end_epoch(self, global_step: int = 0, complete: bool = True):
        """The epoch's averages (``complete``: it ended at ``global_step``); nothing for one left by a stop."""
        if self.is_master and complete and "loss" in self.loss_meters:
            self.epoch_losses.append(self.loss_meters["loss"].avg)
            summary = "  ".join(f"Avg {k.capitalize()}: {m.avg:#.5g}" for k, m in self.loss_meters.items())
            self.log.info(f"End epoch {self.epoch} | {summary}")
            averages = {f"{k}_epoch_avg": m.avg for k, m in self.loss_meters.items()}
            self._scalars("train", averages, max(global_step - 1, 0))
        self.loss_meters = {}
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def eval(self, epoch: int, metrics: Dict[str, float], global_step: int):
        if not self.is_master or not metrics:
            return
        self.evals.append((epoch, dict(metrics)))
        self.log.info(f"Eval Epoch: {epoch} " + "\t".join(f"{k}: {v:.4f}" for k, v in metrics.items()))
        self._append_result(metrics)
        self._scalars("val", metrics, epoch, wandb_step=max(global_step - 1, 0))

    def _append_result(self, metrics: Dict[str, float]):
        if self.results_file is not None:
            with writing(self.results_file):
                append_line(self.results_file, json.dumps(metrics) + "\n")

    def flush(self):
        """Tensorboard's pending events to disk (the liveness listener's last act before it ends the process)."""
        if self.writer is not None:
            self.writer.flush()

    def close(self):
        self.end_epoch(complete=False)  # an epoch still open here was left by an error
        if self.wandb is not None:
            run, self.wandb = self.wandb, None
            run.finish()
        if self.writer is not None:
            writer, self.writer = self.writer, None
            try:
                with writing(writer.log_dir):
                    writer.close()
            finally:
                threading.excepthook = self.hook


def train_scalars(info: dict, elapsed: float) -> dict:
    """``train/*`` of one log: upstream open_clip main's names and meanings first, then this trainer's own."""
    steps = info["steps"]
    scalars = {"data_time": info["data_time"], "batch_time": elapsed / steps,
               "samples_per_second": info["samples_global"] / elapsed,
               "samples_per_second_per_gpu": info["samples"] / elapsed,
               "logit_scale": info["logit_scale"], "lr": info["lr"]}
    if info.get("logit_bias") is not None:
        scalars["logit_bias"] = info["logit_bias"]
    scalars.update(info["losses"])
    scalars.update(window_scale=info["window_scale"], window_samples=info["samples_global"] / steps,
                   image_tokens_per_second=info["tokens_global"] / elapsed)
    return scalars


def write_params(path, args) -> None:
    """``name: value`` per flag, sorted, as open_clip's params.txt."""
    with writing(path), open(path, "w") as f:
        for name in sorted(vars(args)):
            f.write(f"{name}: {getattr(args, name)}\n")


def log_file_only(line: str) -> None:
    """``line`` as an ERROR record in out.log alone: another rank's failure, which rank 0 prints on stderr."""
    logger = logging.getLogger(LOGGER_NAME)
    record = logger.makeRecord(LOGGER_NAME, logging.ERROR, __file__, 0, line, None, None)
    for handler in list(logger.handlers):
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)
