"""upstream.faults: each fault read off the rows that can show it; None where no row can."""
from types import SimpleNamespace

from naflex_accum.upstream.faults import FAULTS, describe, diagnose, still_changed


def _row(mode, stochastic, tower=0.0, ratio=1.0, tol=1e-3):
    return SimpleNamespace(mode=mode, stochastic=stochastic, tower_rel_err=tower, logit_ratios={"logit_scale": ratio},
                           tol=tol)


GOOD = [_row("linear", False), _row("none", False), _row("none", True)]


def test_a_good_step_has_every_fix():
    assert diagnose(GOOD, naflex=True) == {k: True for k in FAULTS}


def test_each_failing_row_shows_its_own_fault_alone():
    assert diagnose([_row("linear", False, tower=0.5)] + GOOD[1:], True)["window-scale"] is False
    found = diagnose([GOOD[0], _row("none", False, ratio=2.0), GOOD[2]], True)
    assert found == {"window-scale": True, "logit-once": False, "stochastic-replay": True}
    found = diagnose(GOOD[:2] + [_row("none", True, tower=0.5, ratio=3.0)], True)
    assert found == {"window-scale": True, "logit-once": True, "stochastic-replay": False}


def test_no_row_that_can_tell_gives_none():
    assert diagnose(GOOD, naflex=False)["window-scale"] is None  # a dense window has no loss scale to get wrong
    errored = [SimpleNamespace(error="boom", mode="none", stochastic=True)]
    assert diagnose(errored, True) == {k: None for k in FAULTS}


def test_words_for_the_audit_and_the_patch():
    found = {"window-scale": True, "logit-once": False, "stochastic-replay": None}
    assert describe(found) == ("has: one loss scale per window; lacks: the logit gradient counted once; not shown: "
                               "stochastic layers replayed with the caching pass's masks")
    changes = still_changed(found, "cached-loss")
    assert changes[:2] == [FAULTS["logit-once"], FAULTS["stochastic-replay"]] and len(changes) == 4
    assert len(still_changed({k: True for k in FAULTS}, "replay")) == 1
