"""Stand-ins for upstream open_clip main's ``_train_step_eager``, for tests run without upstream installed.

A test puts one on ``open_clip_train.train`` (open_clip 3.3.0 has no such
attribute) through the ``upstream_train`` fixture, which puts the module's
attribute back exactly as it was (absent on 3.3.0) after the test.
``buggy_step`` has upstream's exact signature and upstream's behaviour (per-replay
scale, logit parameters counted per replay, no RNG replay); the others differ
in signature only.
"""
import sys

import pytest

from naflex_accum.accum.contract import REPORT
from naflex_accum.testing.bugs import upstream_style_step
from naflex_accum.upstream.probe import Probe

MODULE = "open_clip_train.train"
NAME = "_train_step_eager"


def buggy_step(task, batch, accum_state, optimizer, scaler, autocast, args):
    return upstream_style_step(task, batch, accum_state, optimizer, scaler, autocast, args)


def extra_param_step(task, batch, accum_state, optimizer, scaler, autocast, args, extra=None):
    return upstream_style_step(task, batch, accum_state, optimizer, scaler, autocast, args)


def renamed_param_step(task, batch, state, optimizer, scaler, autocast, args):
    return upstream_style_step(task, batch, state, optimizer, scaler, autocast, args)


def varargs_step(*args, **kwargs):
    return upstream_style_step(*args, **kwargs)


def target_module():
    import open_clip_train.train as module
    return module


def through_module(task, batch, accum_state, optimizer, scaler, autocast, args):
    """Upstream's ``train_one_epoch`` call: the module global, looked up at call time."""
    return getattr(sys.modules[MODULE], NAME)(task, batch, accum_state, optimizer, scaler, autocast, args)


@pytest.fixture
def upstream_train(monkeypatch):
    """``open_clip_train.train`` with its ``_train_step_eager`` state put back exactly after the test."""
    module = target_module()
    had, before = hasattr(module, NAME), getattr(module, NAME, None)
    monkeypatch.setattr("naflex_accum.upstream.patch._announced", True)  # keep test logs quiet by default
    # open_clip 3.3.0 has no upstream task classes to probe with: a stand-in speaks the current contract.
    monkeypatch.setattr("naflex_accum.upstream.patch.probe_contract", lambda module, original: Probe(REPORT))
    yield module
    if had:
        setattr(module, NAME, before)
    elif hasattr(module, NAME):
        delattr(module, NAME)


@pytest.fixture
def stand_in(upstream_train):
    """Upstream's signature on ``open_clip_train.train``, as upstream main has it."""
    setattr(upstream_train, NAME, buggy_step)
    return buggy_step
