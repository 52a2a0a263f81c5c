"""Save-and-exit requests before a SLURM time limit (or any time), agreed on by every rank.

Invariant: a stop is honoured only at an optimizer-step boundary and only when
every rank agrees (one small all-reduce per step), so all ranks leave the same
step and the mid-epoch checkpoint describes one consistent state. A request is
SIGUSR1 to a trainer process, or a ``STOP`` file in the run folder (what
launch/slurm.sbatch writes when SLURM signals the batch script, since torchrun
does not forward SIGUSR1 to its workers).
"""
import signal
import threading
from pathlib import Path


class Preempted(Exception):
    """Raised by the loop after the step at which every rank agreed to stop."""

    def __init__(self, step_in_epoch: int):
        super().__init__(f"stop requested; leaving after step {step_in_epoch} of the epoch")
        self.step_in_epoch = step_in_epoch


class StopRequest:
    def __init__(self, stop_file: Path, world):
        self.stop_file = Path(stop_file)
        self.world = world
        self._flag = False
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGUSR1, self._on_signal)

    def _on_signal(self, signum, frame):
        self._flag = True

    def clear(self) -> None:
        """Forget a request from before this (re)start: a requeued job must not stop at once."""
        self._flag = False
        if self.world.is_master:
            self.stop_file.unlink(missing_ok=True)

    def requested(self) -> bool:
        return self.world.any(self._flag or self.stop_file.exists())
