"""train.saver: which checkpoint files an epoch or a step writes, which retention deletes, and none written
from non-finite weights."""
import argparse
from types import SimpleNamespace

import pytest
import torch

from naflex_accum.train import saver
from naflex_accum.train.distributed import World
from naflex_accum.train.rundir import RunPaths


@pytest.fixture
def make(tmp_path, monkeypatch):
    finite = {"ok": True}
    monkeypatch.setattr(saver, "weights_finite", lambda model, world: finite["ok"])
    monkeypatch.setattr(saver, "gather_states", lambda state, model: (None, None))
    monkeypatch.setattr(saver, "gather_rng_states", lambda world: [])
    monkeypatch.setattr(saver, "epoch_payload", lambda state, model, args, states: {"epoch": state.epoch})
    monkeypatch.setattr(saver, "mid_epoch_payload",
                        lambda state, model, args, world, rng, states: {"global_step": state.global_step})
    paths = RunPaths(tmp_path)
    paths.checkpoints.mkdir()

    def _make(**kw):
        base = dict(save_every_n_steps=0, keep_last=2, save_frequency=1, epochs=5, save_most_recent=False,
                    delete_previous_checkpoint=False)
        base.update(kw)
        return saver.Saver(paths, argparse.Namespace(**base), World(), model=None)
    _make.finite = finite
    _make.files = lambda: sorted(p.name for p in paths.checkpoints.iterdir())
    return _make


def _state(epoch=0, step=0):
    return SimpleNamespace(epoch=epoch, global_step=step)


def test_epoch_files_by_save_frequency_and_the_last_epoch(make):
    s = make(save_frequency=2, epochs=5)
    for epoch in range(1, 6):
        s.save_epoch(_state(epoch))
    assert make.files() == ["epoch_2.pt", "epoch_4.pt", "epoch_5.pt"]
    payload = torch.load(s.paths.checkpoint(4), weights_only=True)
    assert payload == {"epoch": 4}  # what the payload holds, nothing added


def test_delete_previous_and_save_most_recent(make):
    s = make(save_frequency=1, delete_previous_checkpoint=True, save_most_recent=True)
    for epoch in (1, 2, 3):
        s.save_epoch(_state(epoch))
    assert make.files() == ["epoch_3.pt", "epoch_latest.pt"] and s.last_good == s.paths.most_recent
    assert torch.load(s.paths.most_recent, weights_only=True)["epoch"] == 3


def test_step_checkpoints_keep_the_newest_and_a_stop_file_is_superseded(make):
    s = make(save_every_n_steps=3, keep_last=2)
    assert [g for g in range(1, 10) if s.step_due(g)] == [3, 6, 9] and not make(save_every_n_steps=0).step_due(3)
    s.save_stop(_state(step=2))
    assert make.files() == ["epoch_latest.pt"]
    for g in (3, 6, 9):
        s.save_step(_state(step=g))
    assert make.files() == ["step_6.pt", "step_9.pt"]  # epoch_latest.pt went once a newer file was complete


def test_nothing_is_written_from_non_finite_weights(make):
    s = make()
    make.finite["ok"] = False
    with pytest.raises(saver.NonFiniteWeights):
        s.save_epoch(_state(1))
    with pytest.raises(saver.NonFiniteWeights):
        s.save_step(_state(step=1))
    assert make.files() == [] and s.last_good is None
