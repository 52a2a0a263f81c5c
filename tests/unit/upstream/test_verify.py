"""``naflex-accum verify``: exit 0 on our step, non-zero on a buggy one, and it audits what training would use.

Without upstream installed (open_clip 3.3.0) the default audits the trainer's
default step (``naflex_accum.cached_loss_step``) on the built-in task; with a stand-in of
upstream's step on ``open_clip_train.train`` it audits that step through the
module with the patch in effect, and leaves the stand-in in place afterwards.
"""

import json

import pytest
from upstream_stand_in import NAME, renamed_param_step

from naflex_accum import cli
from naflex_accum.commands import verify

ROWS = len(verify.LOSS_SCALES) * len(verify.VERIFY_SPLITS) * 2


@pytest.fixture
def few_cases(monkeypatch):
    """Two rows instead of the full set, for tests about which step is chosen."""
    monkeypatch.setattr(verify, "LOSS_SCALES", ("linear",))
    monkeypatch.setattr(verify, "VERIFY_SPLITS", ((1, 2),))


def run(capsys, *argv):
    code = cli.main(["verify", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_verify_fails_on_a_per_replay_scale_step(capsys):
    code, out, _ = run(capsys, "--step", "naflex_accum.testing.bugs:per_replay_scale_step")
    assert code == 1
    rows = [line for line in out.splitlines() if line.startswith("clip ")]
    assert len(rows) == ROWS
    assert all(row.endswith("FAIL") for row in rows if " linear " in row or " sqrt " in row)
    assert all(row.endswith("PASS") for row in rows if " none " in row)  # no scale, no bug
    assert "FAIL: this step's update depends on how a window is split" in out


def test_verify_json_siglip_reports_logit_bias(capsys, few_cases):
    code, out, _ = run(capsys, "--loss", "siglip", "--json", "--step", "naflex_accum.testing.bugs:logit_k_times_step")
    report = json.loads(out)
    assert code == 1 and report["passed"] is False and report["loss"] == "siglip"
    assert len(report["rows"]) == 2
    for row in report["rows"]:
        assert row["logit_ratios"]["logit_bias"] == pytest.approx(2.0, rel=1e-4)
        assert row["split"] == [1, 2] and row["mode"] == "linear" and row["passed"] is False


def test_verify_audits_the_patched_upstream_step_when_upstream_is_there(stand_in, upstream_train, capsys,
                                                                         few_cases):
    code, out, _ = run(capsys)
    assert code == 0, out
    assert "step: open_clip_train.train._train_step_eager with naflex_accum.install() in effect" in out
    assert getattr(upstream_train, NAME) is stand_in  # patch taken out again


def test_verify_step_flag_shows_the_unpatched_upstream_bug(stand_in, upstream_train, capsys, few_cases):
    code, out, _ = run(capsys, "--step", "open_clip_train.train:_train_step_eager")
    assert code == 1 and "nothing patched" in out
    assert [line for line in out.splitlines() if line.startswith("clip ")][0].endswith("FAIL")


def test_verify_with_a_mismatched_upstream_says_so_and_audits_ours(upstream_train, capsys, few_cases):
    setattr(upstream_train, NAME, renamed_param_step)
    code, out, _ = run(capsys)
    assert code == 0
    assert "cannot be patched here" in out and "would refuse to run" in out
    assert "step: naflex_accum.cached_loss_step" in out
    assert getattr(upstream_train, NAME) is renamed_param_step


@pytest.mark.parametrize("argv,message", [
    (["--step", "no_colon"], "--step 'no_colon': expected MODULE:FUNCTION"),
    (["--step", "no_such_module_xyz:f"], "cannot import 'no_such_module_xyz'"),
    (["--step", "naflex_accum.testing.bugs:not_there"], "has no callable 'not_there'"),
])
def test_bad_step_is_one_clear_line(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith("naflex-accum verify: error: ") and message in err and len(err.splitlines()) == 1


def test_bad_loss_names_the_flag_and_choices(capsys):
    assert cli.main(["verify", "--loss", "sigmoid"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert "--loss" in err and "'clip'" in err and "'siglip'" in err
