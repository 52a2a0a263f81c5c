"""install / uninstall / patched / is_installed against open_clip 3.3.0 and stand-ins of upstream's step.

No upstream open_clip main here: open_clip 3.3.0 has ``open_clip_train.train``
without ``_train_step_eager``, so the tests put stand-ins of upstream's
signature on it (restored after each test by the fixtures).
"""

import logging
import sys

import pytest
from upstream_stand_in import NAME, extra_param_step, renamed_param_step, through_module, varargs_step

import naflex_accum
from naflex_accum.upstream import patch
from naflex_accum.upstream.audit import audit_case
from naflex_accum.upstream.patch import EXPECTED, PatchError, install, is_installed, patched, uninstall


def test_lazy_exports_are_the_patch_api():
    for name in ("install", "uninstall", "patched", "is_installed", "PatchError"):
        assert getattr(naflex_accum, name) is getattr(patch, name)


def test_install_on_open_clip_3_3_raises_patch_error_naming_everything(upstream_train):
    if hasattr(upstream_train, NAME):
        pytest.skip("this open_clip has _train_step_eager (not 3.3.0)")
    with pytest.raises(PatchError) as info:
        install()
    msg = str(info.value)
    version = patch.open_clip_version()
    assert f"open_clip_torch {version}" in msg
    assert EXPECTED in msg  # what was expected
    assert "found no attribute '_train_step_eager' in open_clip_train.train" in msg
    assert "`naflex-accum train` works with any open_clip" in msg
    assert "\n" not in msg
    assert info.value.missing and info.value.version == version
    assert not hasattr(upstream_train, NAME) and not is_installed()


def test_install_replaces_stand_in_and_a_call_time_lookup_gets_ours(stand_in, upstream_train, make_task):
    before = audit_case(through_module, make_task, "clip", "linear", (1, 2))
    assert not before.passed  # the stand-in has upstream's bug

    fn = install()
    assert getattr(upstream_train, NAME) is fn and is_installed()
    assert fn.__wrapped__ is stand_in
    assert fn is not naflex_accum.train_step_eager  # a wrapper of ours, marked as ours
    after = audit_case(through_module, make_task, "clip", "linear", (1, 2))
    assert after.passed, after


def test_second_install_changes_nothing(stand_in, upstream_train):
    first = install()
    assert install() is first
    assert getattr(upstream_train, NAME) is first and first.__wrapped__ is stand_in


def test_uninstall_restores_the_stand_in_once(stand_in, upstream_train):
    install()
    assert uninstall() is True
    assert getattr(upstream_train, NAME) is stand_in and not is_installed()
    assert uninstall() is False
    assert getattr(upstream_train, NAME) is stand_in


def test_uninstall_leaves_someone_elses_patch_alone(stand_in, upstream_train):
    install()

    def theirs(task, batch, accum_state, optimizer, scaler, autocast, args):
        return None
    setattr(upstream_train, NAME, theirs)
    assert uninstall() is False
    assert getattr(upstream_train, NAME) is theirs


@pytest.mark.parametrize("other", [extra_param_step, renamed_param_step, varargs_step], ids=lambda f: f.__name__)
def test_stand_in_with_another_signature_is_refused(upstream_train, other):
    import inspect

    setattr(upstream_train, NAME, other)
    with pytest.raises(PatchError) as info:
        install()
    msg = str(info.value)
    assert EXPECTED in msg and f"found open_clip_train.train._train_step_eager{inspect.signature(other)}" in msg
    assert "`naflex-accum train` works with any open_clip" in msg and "force=True" in msg
    assert getattr(upstream_train, NAME) is other and not is_installed()


def test_non_callable_attribute_is_refused(upstream_train):
    setattr(upstream_train, NAME, 42)
    with pytest.raises(PatchError, match="a int, not a function"):
        install()


def test_force_installs_over_a_mismatch_with_a_warning(upstream_train):
    setattr(upstream_train, NAME, extra_param_step)
    with pytest.warns(RuntimeWarning, match="Installing anyway because force=True"):
        fn = install(force=True)
    assert getattr(upstream_train, NAME) is fn and fn.__wrapped__ is extra_param_step
    assert uninstall() and getattr(upstream_train, NAME) is extra_param_step


def test_force_on_open_clip_3_3_adds_then_removes_the_attribute(upstream_train):
    if hasattr(upstream_train, NAME):
        pytest.skip("this open_clip has _train_step_eager (not 3.3.0)")
    with pytest.warns(RuntimeWarning, match="no attribute"):
        fn = install(force=True)
    assert getattr(upstream_train, NAME) is fn and not hasattr(fn, "__wrapped__")
    assert uninstall() and not hasattr(upstream_train, NAME)


def test_patched_context_installs_and_restores(stand_in, upstream_train):
    with patched() as fn:
        assert getattr(upstream_train, NAME) is fn and is_installed()
    assert getattr(upstream_train, NAME) is stand_in
    with pytest.raises(KeyError):
        with patched():
            raise KeyError("boom")
    assert getattr(upstream_train, NAME) is stand_in


def test_patched_keeps_a_patch_that_was_there_before(stand_in, upstream_train):
    fn = install()
    with patched() as inner:
        assert inner is fn
    assert getattr(upstream_train, NAME) is fn


def test_patched_refuses_like_install(upstream_train):
    setattr(upstream_train, NAME, renamed_param_step)
    with pytest.raises(PatchError):
        with patched():
            pytest.fail("entered the block without a patch")
    assert getattr(upstream_train, NAME) is renamed_param_step


def test_logs_once_on_rank_zero(stand_in, upstream_train, monkeypatch, caplog):
    monkeypatch.setattr(patch, "_announced", False)
    monkeypatch.setenv("RANK", "0")
    caplog.set_level(logging.INFO, logger="naflex_accum.upstream.patch")
    for _ in range(3):
        install()
        install()
        uninstall()
    lines = [r for r in caplog.records if "replaced by naflex_accum.cached_loss_step" in r.getMessage()]
    assert len(lines) == 1


def test_logs_nothing_on_other_ranks(stand_in, upstream_train, monkeypatch, caplog):
    monkeypatch.setattr(patch, "_announced", False)
    monkeypatch.setenv("RANK", "3")
    caplog.set_level(logging.DEBUG, logger="naflex_accum.upstream.patch")
    install()
    assert not [r for r in caplog.records if "replaced" in r.getMessage()]


def test_unconfigured_logging_gets_one_stderr_line(stand_in, upstream_train, monkeypatch, capsys):
    # Launchers install before they set up logging; the line must not vanish.
    monkeypatch.setattr(patch, "_announced", False)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(patch._log, "hasHandlers", lambda: False)
    install()
    uninstall()
    install()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("naflex-accum: open_clip_train.train._train_step_eager replaced")


def test_logging_at_warning_gets_one_stderr_line(stand_in, upstream_train, monkeypatch, capsys):
    # Configured, but an INFO record would be dropped: the line goes to stderr instead.
    monkeypatch.setattr(patch, "_announced", False)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(patch._log, "hasHandlers", lambda: True)
    monkeypatch.setattr(patch._log, "isEnabledFor", lambda level: level >= logging.WARNING)
    install(mode="replay")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "(accumulation mode replay:" in err[0]


def test_is_installed_does_not_import_open_clip(monkeypatch):
    monkeypatch.delitem(sys.modules, "open_clip_train.train", raising=False)
    assert is_installed() is False
    assert "open_clip_train.train" not in sys.modules


@pytest.fixture
def step_calls(monkeypatch):
    """Replace both mode steps by recorders, so a test sees which one the patched function calls."""
    from naflex_accum.accum import cached_loss, replay

    calls = []
    monkeypatch.setattr(replay.ReplayStep, "__call__", lambda self, *a: calls.append("replay_step"))
    monkeypatch.setattr(cached_loss.CachedLossStep, "__call__", lambda self, *a: calls.append("cached_loss_step"))
    monkeypatch.delenv("NAFLEX_ACCUM_MODE", raising=False)
    return calls


@pytest.mark.parametrize("mode,name", [(None, "cached_loss_step"), ("cached-loss", "cached_loss_step"),
                                       ("replay", "replay_step")])
def test_install_mode_selects_the_step(stand_in, upstream_train, step_calls, mode, name):
    """The patched step defaults to the cached-loss mode (exact and faster); install(mode=...) chooses."""
    with patched(mode=mode):
        getattr(upstream_train, NAME)(*[None] * 7)
    assert step_calls == [name]


def test_env_var_picks_the_mode_and_bad_modes_fail_first(stand_in, upstream_train, step_calls, monkeypatch):
    from naflex_accum.errors import UsageError

    monkeypatch.setenv("NAFLEX_ACCUM_MODE", "replay")
    with patched():
        getattr(upstream_train, NAME)(*[None] * 7)
    assert step_calls == ["replay_step"]
    monkeypatch.setenv("NAFLEX_ACCUM_MODE", "fast")
    with pytest.raises(UsageError, match="NAFLEX_ACCUM_MODE=fast: unknown accumulation mode"):
        install()
    assert getattr(upstream_train, NAME) is stand_in


@pytest.mark.parametrize("generation", ["report", "losses"])
def test_install_over_another_mode_or_contract_is_refused_and_changes_nothing(stand_in, upstream_train, monkeypatch,
                                                                               generation):
    from naflex_accum.accum.cached_loss import CachedLossStep
    from naflex_accum.accum.contract import LOSSES, REPORT
    from naflex_accum.errors import StepError

    monkeypatch.delenv("NAFLEX_ACCUM_MODE", raising=False)
    contract, other = (REPORT, LOSSES) if generation == "report" else (LOSSES, REPORT)
    first = install(contract=contract)
    refusals = [
        (dict(mode="replay"), r"install\(mode='replay'\): the cached-loss step is already installed; uninstall\(\) "
                              r"first to switch modes"),
        (dict(contract=other), rf'install\(contract=\.\.\.\) asks for contract "{other.name}".*the installed step '
                               rf'speaks contract "{contract.name}"'),
    ]
    for kw, match in refusals:
        for attempt in (install, lambda **kw: patched(**kw).__enter__()):
            with pytest.raises(StepError, match=match) as info:
                attempt(**kw)
            assert "\n" not in str(info.value)
            assert getattr(upstream_train, NAME) is first and type(first.step) is CachedLossStep
    assert install(mode="cached-loss", contract=contract) is first and install() is first  # the same: no-op
    assert uninstall() and install(mode="replay").mode == "replay"
    with pytest.raises(StepError, match=r"install\(mode=None, that is cached-loss \(\$NAFLEX_ACCUM_MODE, else the "
                                        r"default\)\): the replay step is already installed"):
        install()
    monkeypatch.setenv("NAFLEX_ACCUM_MODE", "replay")
    assert install() is getattr(upstream_train, NAME)
