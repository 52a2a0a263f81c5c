"""Capture and replay of the random state around one microbatch forward.

Invariant: a replay under ``RngState.replay()`` draws exactly what its caching forward drew, on the CPU and
every CUDA device its tensors live on, and leaves the stream outside as if no replay had run (GradCache's
``RandContext``). The same type carries a process's random state into a checkpoint and back.
"""
from contextlib import contextmanager
from typing import Iterable, List, Optional

import torch


def _tensors(obj) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)


def cuda_devices_of(obj) -> List[int]:
    """CUDA device indices used by the tensors in a (nested) batch."""
    devices = {t.device.index for t in _tensors(obj) if t.is_cuda}
    if devices and torch.cuda.is_available():
        devices.add(torch.cuda.current_device())
    return sorted(d for d in devices if d is not None)


class RngState:
    """The CPU generator state, plus the states of the CUDA devices in use: one per microbatch for the step,
    a process's (``current()``, ``to_dict()``, ``restore()``) for a checkpoint."""

    def __init__(self, devices: List[int], cpu: Optional[torch.Tensor] = None,
                 cuda: Optional[List[torch.Tensor]] = None):
        self.devices = list(devices)
        self.cpu = torch.get_rng_state() if cpu is None else cpu
        self.cuda = [torch.cuda.get_rng_state(d) for d in self.devices] if cuda is None else list(cuda)

    @classmethod
    def capture(cls, batch) -> "RngState":
        return cls(cuda_devices_of(batch))

    @classmethod
    def current(cls) -> "RngState":
        """This process's state: the CPU generator and, once CUDA is in use, the current device's."""
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        return cls([torch.cuda.current_device()] if cuda else [])

    def to_dict(self) -> dict:
        """Plain tensors and ints, which ``torch.load(weights_only=True)`` reads back."""
        return {"cpu": self.cpu, "cuda": list(self.cuda), "cuda_devices": list(self.devices)}

    @classmethod
    def from_dict(cls, saved: dict) -> "RngState":
        return cls(saved.get("cuda_devices", []), saved["cpu"], saved.get("cuda", []))

    def restore(self) -> None:
        """Make this the process's state (the current CUDA device takes the first saved device's)."""
        torch.set_rng_state(self.cpu)
        if self.cuda and torch.cuda.is_available():
            torch.cuda.set_rng_state(self.cuda[0], torch.cuda.current_device())

    @contextmanager
    def replay(self):
        # fork_rng restores the outer state on exit, so replays do not advance
        # (or rewind) the stream that the data pipeline and later steps see.
        with torch.random.fork_rng(devices=self.devices, enabled=True):
            torch.set_rng_state(self.cpu)
            for device, state in zip(self.devices, self.cuda):
                torch.cuda.set_rng_state(state, device)
            yield
