"""Stop requests: SIGTERM, SIGUSR1 or a ``STOP`` file mean "finish this optimizer step, save, exit".

Invariants: a request is honoured only at an optimizer-step boundary (any step,
the last of an epoch included) and only through the loop's check, which every
rank takes at the same step, so all ranks leave after the same step and the
checkpoint describes one consistent state; the process then exits with
``EXIT_STOPPED``. Requests are SIGTERM (SLURM's preemption, ``scancel`` and
time limit; Kubernetes' eviction), SIGUSR1 (``sbatch --signal``), or a ``STOP``
file in the run folder (what launch/slurm.sbatch writes, since torchrun does not
forward SIGUSR1 to its workers). The data loader's workers ignore both
signals, so one sent to the whole process group (as SLURM sends it) does not
kill a worker under the trainer; the previous handlers come back when the run
ends, except in a process that ends with the run (``exits_after_run``): there a
signal after the run has saved is ignored, so a scheduler's SIGTERM landing
during teardown cannot turn a finished, saved run into a killed one.
"""
import signal
import threading
from pathlib import Path

EXIT_STOPPED = 75  # sysexits' EX_TEMPFAIL: stopped on request after saving; run it again to continue
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_process_ends_with_run = False


def exits_after_run() -> None:
    """Called by the entry points (console script, ``python -m``): this process ends when the run does."""
    global _process_ends_with_run
    _process_ends_with_run = True


def process_ends_with_run() -> bool:
    return _process_ends_with_run


class Preempted(Exception):
    """Raised by the loop after the step at which every rank agreed to stop."""

    def __init__(self, step_in_epoch: int):
        super().__init__(f"stop requested; leaving after step {step_in_epoch} of the epoch")
        self.step_in_epoch = step_in_epoch


class StopRequest:
    def __init__(self, stop_file: Path, world):
        self.stop_file = Path(stop_file)
        self.world = world
        self.signalled = None  # the name of the first signal received, or None
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame):
        self.signalled = self.signalled or signal.Signals(signum).name

    def clear(self) -> None:
        """Forget a request from before this (re)start: a requeued job must not stop at once."""
        self.signalled = None
        if self.world.is_master:
            self.stop_file.unlink(missing_ok=True)

    def pending(self) -> bool:
        """This rank's request (a signal, or on rank 0 the STOP file); the loop's check makes it everyone's."""
        return self.signalled is not None or (self.world.is_master and self.stop_file.exists())

    def reason(self) -> str:
        if self.signalled:
            return self.signalled
        return "the STOP file" if self.world.is_master and self.stop_file.exists() else "another rank's request"

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, signal.SIG_IGN if _process_ends_with_run else handler)
        self._previous = {}
