"""The patch finds out which contract it replaces, on each pinned upstream, and on upstreams that moved on.

Each pinned commit must probe as its own generation in every part (5964c41
"losses", 89fb801 "report"). Upstreams that later commits may bring are
emulated in the test process (``upstream_jobs/emulated_upstream.py``, upstream
functions overridden, none of upstream's code copied): a contract that fits
neither generation must be refused by the runner in one line naming the part,
exit 2, before upstream's ``main`` builds anything; an upstream step that fixed
some of the faults itself must be audited as such by ``verify --step``, and the
runner must say what the patch still changes.
"""
import json

import pytest
from upstream_real import DETERMINISTIC, JOBS, last_json, run_python, tail, upstream_env

UPSTREAM_STEP = "open_clip_train.train:_train_step_eager"
PARTS = ("train_one_epoch", "model outputs", "(batch)", ".compute_accum_loss", "upstream's own step")


def test_each_pinned_commit_probes_as_its_generation_in_every_part(pinned, tmp_path):
    found = last_json(run_python(pinned.src, [JOBS / "probe_all.py"], cwd=tmp_path))
    assert found["rng_undisturbed"] and found["threads"] == 2
    unpacked = {"report": "unpacks 4 values (losses, report, step_batch_size, accum_state)",
                "losses": "unpacks 3 values (losses, step_batch_size, accum_state)"}[pinned.contract]
    for kind, probe in found["kinds"].items():
        assert probe["contract"] == pinned.contract and probe["problem"] is None, probe
        parts = probe["parts"]
        assert len(parts) == len(PARTS) and all(any(p.endswith(want) for p in parts) for want in PARTS), parts
        assert parts["train_one_epoch"].startswith(unpacked)
        assert "logit_scale" in parts["model outputs"]
        assert probe["seconds"] < 30


def _emulated(src, changes, *argv, cwd, **env):
    return run_python(src, [JOBS / "emulated_upstream.py", changes, *argv], cwd=cwd,
                      env=upstream_env(src, **DETERMINISTIC, **env))


@pytest.mark.parametrize("changes,part", [
    ("task-object", "found CLIPTask.compute_accum_loss returns a StepLosses; the fix knows (losses, report) "
                    "[upstream from 2026-06-14] or losses alone [2026-05-22 to 2026-06-13]"),
    ("loop-five", "found train_one_epoch unpacks 5 values (losses, report, step_batch_size, accum_state, extra) "
                  "from _train_step_eager; the fix knows (losses, report, step_batch_size, accum_state) or "
                  "(losses, step_batch_size, accum_state)"),
    ("mixed", "found the parts of the contract disagree (train_one_epoch speaks 'losses'; CLIPTask(batch), "
              "CLIPTask.compute_accum_loss, upstream's own step speak 'report')"),
])
def test_an_unknown_contract_is_refused_in_one_line_before_anything_runs(upstream_src, demo_shards, tmp_path,
                                                                        changes, part):
    proc = _emulated(upstream_src, changes, "openclip", "--use-naflex", "--model", "naflex_ViT-B-16",
                     "--train-data", demo_shards, "--accum-freq", "2", "--logs", tmp_path / "logs", cwd=tmp_path)
    assert proc.returncode == 2, tail(proc)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("naflex-accum openclip: error: open_clip_torch 4.2.0.dev0 cannot take the fix: "
                               "expected a task-and-step contract the fix knows, ")
    assert part in lines[0]
    assert not (tmp_path / "logs").exists()  # upstream's main never started


def test_verify_on_an_unknown_contract_says_the_runner_would_refuse(upstream_src, tmp_path):
    proc = _emulated(upstream_src, "task-object", "verify", cwd=tmp_path)
    assert "cannot be patched here (found CLIPTask.compute_accum_loss returns a StepLosses" in proc.stdout
    assert "`naflex-accum openclip` would refuse to run" in proc.stdout


def _fixes(src, changes, tmp_path):
    proc = _emulated(src, changes, "verify", "--json", "--step", UPSTREAM_STEP, cwd=tmp_path)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    return proc.returncode, report


def test_verify_step_shows_what_an_upstream_with_pr_1212_still_gets_wrong(upstream_src, tmp_path):
    code, report = _fixes(upstream_src, "window-scale", tmp_path)
    assert code == 1 and report["fixes"] == {"window-scale": True, "logit-once": False, "stochastic-replay": False}
    rows = report["rows"]
    plain = [r for r in rows if not r["stochastic"]]
    assert max(r["tower_rel_err"] for r in plain) <= 1e-5  # the scale is right now ...
    assert not any(r["passed"] for r in rows)  # ... but the logit gradient is still counted k times
    assert report["verified_in_ci"] is None  # the emulated step is not one CI verified


def test_verify_step_passes_the_plain_rows_of_an_upstream_with_both_fixes(upstream_src, tmp_path):
    code, report = _fixes(upstream_src, "window-scale,logit-once", tmp_path)
    assert code == 1 and report["fixes"] == {"window-scale": True, "logit-once": True, "stochastic-replay": False}
    rows = report["rows"]
    assert all(r["passed"] for r in rows if not r["stochastic"]) and len(rows) == 24
    assert not any(r["passed"] for r in rows if r["stochastic"])  # fresh masks in the replay


def test_the_runner_says_what_the_patch_still_changes_over_a_fixed_upstream(upstream_src, demo_shards, tmp_path):
    from naflex_accum.upstream.tiny_tasks import write_model_dir

    model = write_model_dir(str(tmp_path / "tiny-clip"), "clip")
    proc = _emulated(upstream_src, "window-scale,logit-once", "openclip", "--use-naflex", "--model", model,
                     "--train-data", demo_shards, "--dataset-type", "webdataset", "--train-num-samples", "40",
                     "--batch-size", "16", "--naflex-seq-lens", "16", "64", "--naflex-max-tokens-per-batch", "512",
                     "--accum-freq", "2", "--naflex-loss-scale", "linear", "--epochs", "1", "--workers", "0",
                     "--device", "cpu", "--logs", tmp_path / "logs", "--name", "fixed", cwd=tmp_path)
    assert proc.returncode == 0, tail(proc)
    said = [line for line in proc.stderr.splitlines() if line.startswith("naflex-accum: ")]
    assert said[2].startswith("naflex-accum: self-check: PASS 8/8 rows"), said
    assert said[3] == (
        "naflex-accum: upstream's own step, audited the same way: has: one loss scale per window, the logit "
        "gradient counted once; lacks: stochastic layers replayed with the caching pass's masks. The patch "
        "changes: stochastic layers replayed with the caching pass's masks; the window loss computed once, not "
        "once per microbatch; the last microbatch's caching forward kept for its backward (one forward saved)")
    params = (tmp_path / "logs" / "fixed" / "params.txt").read_text()
    assert "naflex_accum_fingerprint: " in params and "(CLIPTask; not among the upstream versions CI verified)" \
        in params
    assert (tmp_path / "logs" / "fixed" / "checkpoints" / "epoch_1.pt").is_file()
