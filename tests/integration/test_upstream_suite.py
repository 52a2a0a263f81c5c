"""Upstream open_clip's own tests (89fb801) give the same results with the fixed step installed as without.

Upstream's training, task, NaFlex and loss test files run twice, each in its
own copy of the extracted snapshot (upstream's trainer writes ``./logs``): plain,
and under ``-p naflex_accum.testing.pytest_plugin`` (``install()`` before any test
module is imported). Every test must end the same way both times, none may
fail, and the patched session must have called the fixed step. The tests that
need the network fail without it, patched or not, and are left out by name.
Both sessions load ``upstream_jobs/suite_scratch.py`` and keep a failing test's
folders only: a passing test's checkpoints and ``tmp_path`` go as it ends.
"""
import os
import re
import shutil
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest
from upstream_real import SHARED, tail, upstream_env

JOBS = Path(__file__).resolve().parents[1] / "upstream_jobs"  # suite_scratch, the plugin both sessions load
COMMIT = "89fb801"
FILES = [
    # training
    "tests/test_training_simple.py",
    # tasks
    "tests/test_task_base_unit.py", "tests/test_task_checkpoint.py", "tests/test_task_compile.py",
    "tests/test_task_fsdp_unit.py", "tests/test_task_specific_unit.py", "tests/test_factory_task.py",
    "tests/test_eval_task.py", "tests/test_clap_task.py",
    # NaFlex
    "tests/test_naflex.py", "tests/test_naflex_config.py", "tests/test_naflex_timm_conversion.py",
    "tests/test_naflex_genlip.py", "tests/test_naflex_genlap.py", "tests/test_naflexclap.py",
    "tests/test_naflex_audio.py", "tests/test_naflex_audio_data.py",
    # losses
    "tests/test_loss.py", "tests/test_siglip_chunked_loss.py",
]
OFFLINE = {  # fail here, patched or not: they need the network
    "tests/test_training_simple.py::test_training_mt5": "mt5 from the Hugging Face hub (and transformers)",
    "tests/test_naflex_genlip.py::test_tiktoken_tokenizer": "tiktoken's encodings are downloaded",
    "tests/test_naflex_genlip.py::test_tiktoken_clean_option": "tiktoken's encodings are downloaded",
    "tests/test_naflex_genlip.py::test_end_to_end_naflex_pipeline": "tiktoken's encodings are downloaded",
    "tests/test_naflex_genlap.py::test_genlap_tokenizer_is_tiktoken": "tiktoken's encodings are downloaded",
}
PLUGIN = "naflex_accum.testing.pytest_plugin"
TIMEOUT = 1200


def _snapshot(folder):
    """Upstream's source and its own tests, extracted together as the tests archive expects."""
    for name in (f"open_clip-{COMMIT}.tar.gz", f"open_clip-{COMMIT}-tests.tar.gz"):
        path = SHARED / name
        if not path.is_file():
            pytest.skip(f"{path} not found")  # upstream_src (a fixture of this test) fails instead under CI
        with tarfile.open(path) as tar:
            tar.extractall(folder, filter="data")
    return folder / f"open_clip-{COMMIT}"


def _outcomes(junit) -> dict:
    outcomes = {}
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        outcomes[f"{case.get('classname')}::{case.get('name')}"] = kinds[0] if kinds else "passed"
    return outcomes


@pytest.fixture(scope="module")
def sessions(upstream_src, tmp_path_factory):
    """Both sessions at once (two cores), one thread each; returns {name: (process, outcomes)}."""
    runs = {}
    for name, extra in (("plain", []), ("patched", ["-p", PLUGIN])):
        root = _snapshot(tmp_path_factory.mktemp(f"suite-{name}"))
        deselect = [arg for test in OFFLINE for arg in ("--deselect", test)]
        # scratch: each test's checkpoints and tmp_path go when it passes (both sessions hold up to 9 GB otherwise)
        scratch = ["-p", "suite_scratch", f"--basetemp={root / 'pytest-tmp'}", "-o", "tmp_path_retention_policy=failed"]
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", *extra, *scratch,
               f"--junitxml={root / 'junit.xml'}", *deselect, *FILES]
        env = upstream_env(root / "src", OMP_NUM_THREADS="1", NAFLEX_ACCUM_MODE=None, PYTHONDONTWRITEBYTECODE="1")
        env["PYTHONPATH"] += os.pathsep + str(JOBS)
        runs[name] = (root, subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE,
                                             stderr=subprocess.STDOUT, text=True))
    done = {}
    for name, (root, proc) in runs.items():
        out, _ = proc.communicate(timeout=TIMEOUT)
        done[name] = (subprocess.CompletedProcess(proc.args, proc.returncode, out, ""), _outcomes(root / "junit.xml"))
        for folder in ("logs", "pytest-tmp"):  # what failing tests kept, and upstream's run folders
            shutil.rmtree(root / folder, ignore_errors=True)
    return done


def test_no_upstream_test_fails_plain_or_patched(sessions):
    for name, (proc, outcomes) in sessions.items():
        bad = {test: kind for test, kind in outcomes.items() if kind in ("failure", "error")}
        assert proc.returncode == 0 and not bad, f"{name}: {bad}\n{tail(proc)}"
        assert sum(kind == "passed" for kind in outcomes.values()) >= 200, f"{name}: {len(outcomes)} collected"


def test_every_upstream_test_ends_the_same_patched_and_plain(sessions):
    plain, patched = sessions["plain"][1], sessions["patched"][1]
    assert set(plain) == set(patched)
    assert {t: (plain[t], patched[t]) for t in plain if plain[t] != patched[t]} == {}
    assert not any(t.endswith(f"::{name.rsplit('::', 1)[1]}") for t in plain for name in OFFLINE)


def test_the_patched_session_ran_the_fixed_step(sessions):
    out = sessions["patched"][0].stdout
    line = [line for line in out.splitlines() if line.startswith("naflex-accum: ") and "; called " in line]
    assert len(line) == 1 and "replaced by naflex_accum.cached_loss_step" in line[0], tail(sessions["patched"][0])
    calls, steps = re.search(r"; called (\d+) times, (\d+) optimizer steps$", line[0]).groups()
    # test_training_unfreezing_vit: upstream's trainer, --accum-freq 2, two windows of upstream's ViT-B-32
    assert int(calls) >= 4 and int(steps) >= 2, line[0]
    assert "naflex-accum: " not in sessions["plain"][0].stdout
