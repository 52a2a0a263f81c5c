"""Capture and replay of the random state around one microbatch forward.

Invariant: a microbatch replayed under ``RngState.replay()`` draws exactly the
random numbers its caching forward drew (dropout, patch dropout, drop path),
on the CPU and on every CUDA device its tensors live on, and the random stream
outside the replay is left where the caching forwards put it, as if the
replays had never run. (The idea is GradCache's ``RandContext``.)
"""
from contextlib import contextmanager
from typing import Iterable, List

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
    """The CPU generator state, plus the states of the CUDA devices in use."""

    def __init__(self, devices: List[int]):
        self.devices = list(devices)
        self.cpu = torch.get_rng_state()
        self.cuda = [torch.cuda.get_rng_state(d) for d in self.devices]

    @classmethod
    def capture(cls, batch) -> "RngState":
        return cls(cuda_devices_of(batch))

    @contextmanager
    def replay(self):
        # fork_rng restores the outer state on exit, so replays do not advance
        # (or rewind) the stream that the data pipeline and later steps see.
        with torch.random.fork_rng(devices=self.devices, enabled=True):
            torch.set_rng_state(self.cpu)
            for device, state in zip(self.devices, self.cuda):
                torch.cuda.set_rng_state(state, device)
            yield


# ---- a process's random state in a checkpoint (the training loop's save and resume) --------------------


def current_rng_state() -> RngState:
    """This process's state: the CPU generator and, once CUDA is in use, the current device's."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    return RngState([torch.cuda.current_device()] if cuda else [])


def rng_state_dict(state: RngState) -> dict:
    """``state`` as plain tensors and ints, which ``torch.load(weights_only=True)`` reads back."""
    return {"cpu": state.cpu, "cuda": list(state.cuda), "cuda_devices": list(state.devices)}


def load_rng_state_dict(saved: dict) -> None:
    """Set this process's random state to ``saved`` (the current CUDA device takes the saved device's state)."""
    torch.set_rng_state(saved["cpu"])
    if saved.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state(saved["cuda"][0], torch.cuda.current_device())
