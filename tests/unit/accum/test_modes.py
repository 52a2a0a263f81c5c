"""accum.modes: the mode a run uses (argument, else $NAFLEX_ACCUM_MODE, else cached-loss) and its step."""
import pytest

from naflex_accum.accum import cached_loss, replay
from naflex_accum.accum.modes import DEFAULT_MODE, ENV_VAR, get_step, make_step, resolve_mode
from naflex_accum.errors import UsageError


def test_the_argument_then_the_environment_then_the_default(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert resolve_mode() == DEFAULT_MODE == "cached-loss"
    monkeypatch.setenv(ENV_VAR, "replay")
    assert resolve_mode() == "replay" and resolve_mode("cached-loss") == "cached-loss"


def test_an_unknown_mode_names_where_it_came_from(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "fast")
    with pytest.raises(UsageError, match=r"^NAFLEX_ACCUM_MODE=fast: unknown accumulation mode; valid modes are "
                                         r"cached-loss, replay$"):
        resolve_mode()
    with pytest.raises(UsageError, match=r"^--accum-mode slow: unknown"):
        resolve_mode("slow")


def test_each_mode_gets_its_own_step(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert get_step() is cached_loss.cached_loss_step and get_step("replay") is replay.replay_step
    assert isinstance(make_step("replay"), replay.ReplayStep)
    assert isinstance(make_step(), cached_loss.CachedLossStep)
