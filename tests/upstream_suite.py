"""Upstream open_clip's own tests at the pinned 89fb801, run by pytest in a subprocess, and the recorded
outcome of their plain run.

A plain run of a pinned snapshot (no naflex_accum plugin) ends the same way every time on the same torch and
timm, so it is run once and kept in ``RECORD`` (test id -> outcome, with what it ran on), and
``integration/test_upstream_suite.py`` runs only the patched one against it. When the pin, ``FILES``,
``OFFLINE`` or ``LEFT_OUT`` change, or torch or timm move, one command runs the plain run again and rewrites the
record::

    make refresh-upstream-record        # = .venv/bin/python tests/upstream_suite.py

Both runs load ``upstream_jobs/suite_scratch.py``: a passing test's checkpoints and ``tmp_path`` go as it ends.
"""
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import timm
import torch
from upstream_real import SHARED, tail, upstream_env

JOBS = Path(__file__).resolve().parent / "upstream_jobs"  # suite_scratch, the plugin both runs load
COMMIT = "89fb801"
RECORD = Path(__file__).resolve().parent / f"upstream_suite-{COMMIT}.json"
# Upstream's files of the code the fixed step runs in or calls: its trainer, its tasks, NaFlex, losses. Left out:
# test_eval_task.py, test_task_checkpoint.py and test_factory_task.py (a third of its time), whose tests never call
# the step (counted per test in a patched run: only test_training_unfreezing_vit does) and test what it does not
# touch: evaluation, checkpoint files, building models.
FILES = [
    # training
    "tests/test_training_simple.py",
    # tasks
    "tests/test_task_base_unit.py", "tests/test_task_compile.py", "tests/test_task_fsdp_unit.py",
    "tests/test_task_specific_unit.py", "tests/test_clap_task.py",
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
LEFT_OUT = {  # a third of the selection's time, and never call the step (--accum-freq 1)
    "tests/test_training_simple.py::test_training_coca": "CoCa through upstream's trainer at --accum-freq 1; "
                                                          "test_training runs the same path, and the step's CoCa "
                                                          "is test_upstream_verify's",
}
PLUGIN = "naflex_accum.testing.pytest_plugin"
TIMEOUT = 1200


def archives() -> list:
    return [SHARED / f"open_clip-{COMMIT}.tar.gz", SHARED / f"open_clip-{COMMIT}-tests.tar.gz"]


def snapshot(folder: Path) -> Path:
    """Upstream's source and its own tests, extracted together into ``folder`` as the tests archive expects."""
    for path in archives():
        with tarfile.open(path) as tar:
            tar.extractall(folder, filter="data")
    return folder / f"open_clip-{COMMIT}"


def outcomes(junit: Path) -> dict:
    found = {}
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        found[f"{case.get('classname')}::{case.get('name')}"] = kinds[0] if kinds else "passed"
    return found


def run(root: Path, patched: bool, timeout=TIMEOUT):
    """Upstream's ``FILES`` in the snapshot at ``root``, one thread, with ``PLUGIN`` when ``patched``;
    returns ``(CompletedProcess, {test id: outcome})`` and removes the run folders it left."""
    deselect = [arg for test in [*OFFLINE, *LEFT_OUT] for arg in ("--deselect", test)]
    # scratch: each test's checkpoints and tmp_path go when it passes (a run holds up to 9 GB otherwise)
    scratch = ["-p", "suite_scratch", f"--basetemp={root / 'pytest-tmp'}", "-o", "tmp_path_retention_policy=failed"]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", *(["-p", PLUGIN] * patched),
           *scratch, f"--junitxml={root / 'junit.xml'}", *deselect, *FILES]
    env = upstream_env(root / "src", OMP_NUM_THREADS="1", NAFLEX_ACCUM_MODE=None, PYTHONDONTWRITEBYTECODE="1")
    env["PYTHONPATH"] += os.pathsep + str(JOBS)
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    for folder in ("logs", "pytest-tmp"):  # what failing tests kept, and upstream's run folders
        shutil.rmtree(root / folder, ignore_errors=True)
    junit = root / "junit.xml"
    return proc, (outcomes(junit) if junit.is_file() else {})


def environment() -> dict:
    """What a plain run's outcome depends on besides the snapshot: the selection and the libraries it runs on."""
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    return {"commit": COMMIT, "files": FILES, "offline": sorted(OFFLINE), "left_out": sorted(LEFT_OUT),
            "python": python,
            "torch": torch.__version__, "timm": timm.__version__}


def refresh() -> int:
    """Run upstream's tests plain and write ``RECORD``; refuse (exit 1, nothing written) if any test fails."""
    missing = [str(path) for path in archives() if not path.is_file()]
    if missing:
        print(f"upstream_suite: {missing[0]} not found (the pinned snapshot lives in ../shared/upstream)",
              file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="upstream-suite-") as tmp:
        proc, found = run(snapshot(Path(tmp)), patched=False, timeout=None)  # a busy machine may take long
    bad = sorted(test for test, kind in found.items() if kind in ("failure", "error"))
    if proc.returncode != 0 or bad or "naflex-accum: " in proc.stdout:
        print(f"{tail(proc)}\nupstream_suite: the plain run did not pass (exit {proc.returncode}, failing: "
              f"{bad[:5]}); {RECORD.name} left as it was", file=sys.stderr)
        return 1
    RECORD.write_text(json.dumps({**environment(), "outcomes": dict(sorted(found.items()))}, indent=1) + "\n")
    counts = {kind: sum(v == kind for v in found.values()) for kind in sorted(set(found.values()))}
    print(f"upstream_suite: wrote {RECORD} ({', '.join(f'{n} {kind}' for kind, n in counts.items())})")
    return 0


if __name__ == "__main__":
    sys.exit(refresh())
