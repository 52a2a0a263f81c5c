"""The lines a run ends with: what a finished run reached, or why a resume had nothing to train.

Invariants: rank 0 alone writes them, through the run's logger; a resume with nothing left to train changes
nothing in the run folder and ends with exit 0.
"""
import logging
from typing import Optional

log = logging.getLogger(__name__)


def finished(state, args) -> bool:
    """The state (a resumed checkpoint's) has every epoch of ``--epochs`` behind it."""
    return state.epoch >= args.epochs


def nothing_to_do(resumed, state, args) -> str:
    where = f"is at step {state.step_in_epoch} of epoch {state.epoch}" if state.step_in_epoch else \
        f"holds {state.epoch} finished epoch{'s' if state.epoch != 1 else ''}"
    return (f"Nothing to do: {resumed} {where} (global step {state.global_step}) and --epochs is "
            f"{args.epochs}; nothing was trained or changed. To train on, pass a larger --epochs")


def log_nothing_to_do(resumed, state, args, run_folder: str) -> dict:
    """Say so, and return what ``main.run`` returns for a run that trained nothing."""
    log.info(nothing_to_do(resumed, state, args))
    return {"run_folder": run_folder, "metrics": {}, "epoch": state.epoch, "preempted": False, "exit_code": 0,
            "last_checkpoint": str(resumed), "global_step": state.global_step, "corrupt": 0, "first_loss": None,
            "epoch_losses": [], "evals": [], "val_samples": 0}


def summary_lines(state, args, run_logger, last_checkpoint: Optional[str]) -> list:
    """One line for the training, one for the last evaluation (if any)."""
    loss = run_logger.epoch_losses[-1] if run_logger.epoch_losses else None
    lines = [f"Finished: epoch {state.epoch}/{args.epochs}, {state.global_step} optimizer steps, "
             f"{state.samples_seen} samples"
             + (f"; last epoch's average loss {loss:#.5g}" if loss is not None else "")
             + f"; last checkpoint: {last_checkpoint or 'none (--save-frequency 0)'}"]
    if run_logger.evals:
        epoch, metrics = run_logger.evals[-1]
        shown = {k: v for k, v in metrics.items() if k not in ("epoch", "num_samples")}  # results.jsonl's counters
        lines.append(f"Final eval (epoch {epoch}): " + ", ".join(f"{k} {v:.4f}" for k, v in shown.items()))
    return lines


def log_summary(state, args, run_logger, last_checkpoint: Optional[str]) -> None:
    for line in summary_lines(state, args, run_logger, last_checkpoint):
        log.info(line)
