"""When the trainer writes which checkpoint, and which ones it keeps.

Invariants: rank 0 writes, every rank takes part (a failed write stops every rank with rank 0's line); no
checkpoint is written from non-finite weights; retention deletes only after a newer file is complete, never
the one just written; a payload is built once however many files get it. docs/long-runs.md, "What is saved when".
"""
import logging
from pathlib import Path
from typing import List, Optional

from ..monitor import host_read
from .checkpoint import prune_step_checkpoints, remove_file, save_checkpoint
from .resume import epoch_payload, gather_rng_states, gather_states, mid_epoch_payload, weights_finite
from .rundir import on_master

log = logging.getLogger(__name__)


class NonFiniteWeights(Exception):
    """The weights about to be saved are not finite; nothing was written."""


class Saver:
    def __init__(self, paths, args, world, model, last_good: Optional[Path] = None):
        self.paths, self.args, self.world, self.model = paths, args, world, model
        self.last_good = last_good  # the newest checkpoint known complete and finite (for messages)
        self.undeletable = set()  # rank 0: files retention could not delete (warned about once)

    def step_due(self, global_step: int) -> bool:
        every = self.args.save_every_n_steps
        return bool(every) and global_step % every == 0

    def save_step(self, state) -> None:
        path = self.paths.step_checkpoint(state.global_step)
        self._write_mid_epoch(path, state)
        on_master(self.world, prune_step_checkpoints, self.paths.checkpoints, self.args.keep_last, path,
                  self.undeletable)

    def save_stop(self, state) -> Path:
        path = self.paths.most_recent
        self._write_mid_epoch(path, state)
        return path

    def save_epoch(self, state) -> None:
        """After epoch ``state.epoch`` (already counted as complete) and its evaluation."""
        args, epoch = self.args, state.epoch
        due = bool(args.save_frequency) and (epoch % args.save_frequency == 0 or epoch == args.epochs)
        paths = [self.paths.checkpoint(epoch)] if due else []
        paths += [self.paths.most_recent] if args.save_most_recent else []
        if paths:  # one weights check and one payload, however many files get it
            self._write(paths, lambda states: epoch_payload(state, self.model, args, states), state)
        if due and args.delete_previous_checkpoint and epoch - args.save_frequency > 0:
            on_master(self.world, remove_file, self.paths.checkpoint(epoch - args.save_frequency),
                      "--delete-previous-checkpoint", self.undeletable)

    def _write_mid_epoch(self, path: Path, state) -> None:
        rng_states = gather_rng_states(self.world)
        self._write([path], lambda states: mid_epoch_payload(state, self.model, self.args, self.world, rng_states,
                                                             states), state)

    def _write(self, paths: List[Path], make_payload, state) -> None:
        with host_read():  # a save reads the device (the weights check, the state to the CPU) by design
            if not weights_finite(self.model, self.world):
                raise NonFiniteWeights(paths[0])
            states = gather_states(state, self.model)  # every rank: under --fsdp the gather is a collective
            on_master(self.world, self._write_on_master, paths, lambda: make_payload(states))
        self.last_good = paths[-1]

    def _write_on_master(self, paths: List[Path], make_payload) -> None:
        payload = make_payload()
        for path in paths:
            save_checkpoint(path, payload)
        most_recent = self.paths.most_recent
        if most_recent not in paths and not self.args.save_most_recent:  # superseded by ``paths``
            remove_file(most_recent, f"superseded by {paths[-1].name}", self.undeletable)
