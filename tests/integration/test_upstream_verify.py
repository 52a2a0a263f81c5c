"""``naflex-accum verify`` on each pinned upstream open_clip main: CLIP, SigLIP and CoCa, both modes.

One subprocess per pinned commit runs every case (``upstream_jobs/verify_all.py``).
With the patch installed, upstream's ``_train_step_eager``, called through its
module, must pass every row on tiny random models built by upstream's own
factory and task classes, speaking that commit's contract generation, and
its fingerprint must be one CI verified on that commit; upstream's own step
(``--step``) must fail, each loss for the reasons the patch exists: the logit
parameters counted once per replay (ratio k), and for NaFlex windows a loss
scale per replay.
"""
import pytest
from upstream_real import JOBS, last_json, run_python

from naflex_accum.accum.modes import ACCUM_MODES

LOSSES = ("clip", "siglip", "coca")
TASKS = {"clip": "CLIPTask", "siglip": "SigLIPTask", "coca": "CoCaTask"}
UPSTREAM_STEP = "open_clip_train.train:_train_step_eager"
ROWS = 24  # 3 loss-scale modes x 4 splits x with/without stochastic layers


@pytest.fixture(scope="module")
def reports(pinned, tmp_path_factory):
    proc = run_python(pinned.src, [JOBS / "verify_all.py"], cwd=tmp_path_factory.mktemp("verify"))
    return pinned, {tuple(case["argv"]): case for case in last_json(proc)}


def _explain(case) -> str:
    report = case["report"] or {}
    bad = [r for r in report.get("rows", []) if not r["passed"]]
    return f"exit {case['code']}; {len(bad)} failing rows, first: {bad[:1]}"


@pytest.mark.parametrize("loss,mode", [pytest.param(loss, mode, id=f"{loss}-{mode}")
                                       for loss in LOSSES for mode in ACCUM_MODES])
def test_verify_passes_on_patched_upstream(reports, loss, mode):
    pinned, reports = reports
    case = reports[("--loss", loss, "--accum-mode", mode)]
    assert case["code"] == 0, _explain(case)
    report = case["report"]
    assert report["open_clip_torch"] == pinned.version  # upstream's source, not the installed 3.3.0
    assert report["contract"].startswith(f'contract "{pinned.contract}"')
    assert report["verified_in_ci"].startswith(f"upstream {pinned.commit} ({pinned.version}")
    assert TASKS[loss] in report["verified_in_ci"] and report["fingerprint_task"] == TASKS[loss]
    assert report["step"].startswith("open_clip_train.train._train_step_eager with naflex_accum.install() "
                                     f"in effect (accumulation mode {mode}:")
    assert report["task"].startswith(f"upstream open_clip {TASKS[loss]} around a tiny random")
    rows = report["rows"]
    assert len(rows) == ROWS and all(r["passed"] for r in rows)
    assert max(r["tower_rel_err"] for r in rows) <= 1e-5
    logits = {"logit_scale", "logit_bias"} if loss == "siglip" else {"logit_scale"}
    for row in rows:
        assert set(row["logit_ratios"]) == logits
        assert all(abs(v - 1.0) <= 1e-5 for v in row["logit_ratios"].values())
        assert row["step_batch_size"] == sum(row["split"])


@pytest.mark.parametrize("loss", LOSSES)
def test_verify_fails_on_upstreams_own_step(reports, loss):
    pinned, reports = reports
    case = reports[("--loss", loss, "--step", UPSTREAM_STEP)]
    assert case["code"] == 1
    report = case["report"]
    assert report["step"] == f"{UPSTREAM_STEP} (as given by --step; nothing patched)"
    assert report["verified_in_ci"].startswith(f"upstream {pinned.commit}")
    # upstream's own step at these commits has none of the three fixes (CoCa's dense windows show no scale)
    assert report["fixes"] == {"window-scale": None if loss == "coca" else False, "logit-once": False,
                               "stochastic-replay": False}
    rows = report["rows"]
    assert len(rows) == ROWS and not any(r["passed"] for r in rows)
    for row in rows:
        if not row["stochastic"] and row["mode"] == "none":  # no scale: only the logit count is wrong
            k = len(row["split"])
            assert all(v == pytest.approx(k, rel=1e-4) for v in row["logit_ratios"].values()), row
    if loss != "coca":  # a loss scale per replay: NaFlex windows only (dense ones are scaled by 1)
        linear = [r for r in rows if r["mode"] == "linear" and not r["stochastic"]]
        assert min(r["tower_rel_err"] for r in linear) > 0.1
