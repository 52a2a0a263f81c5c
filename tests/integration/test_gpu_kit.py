"""The GPU check kit (``benchmarks/gpu_check.sh``) in its CPU smoke mode, end to end, so that it cannot rot.

The full mode runs only where a GPU is lent (``docs/gpu/``); this runs every section of the same code at
tiny sizes on the CPU: the CUDA tests (collected, skipped), the step bench against upstream's real step
from the pinned snapshot, and both trainers (ours, and upstream's through the runner) on demo shards.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from upstream_real import TARBALL, _required

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))


def _kit_upstream() -> bool:
    return TARBALL.is_file() or any((ROOT / ".gpu-kit").glob("upstream/open_clip-*/src"))


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    if not _kit_upstream():
        if _required():
            pytest.fail(f"the pinned upstream {TARBALL} is missing")
        pytest.skip(f"needs the pinned upstream ({TARBALL})")
    out = tmp_path_factory.mktemp("gpu-check")
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "run", "--smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    return proc, out


def test_smoke_mode_runs_every_section(smoke):
    proc, out = smoke
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "0 section(s) broken" in proc.stdout
    report = json.loads((out / "gpu_check.json").read_text())
    sections = report["sections"]
    assert set(sections) == {"tests", "accum", "trainers"}
    assert sections["tests"]["cases"] and all(c["outcome"] in ("passed", "skipped") for c in sections["tests"]["cases"])
    accum = sections["accum"]["data"]
    assert {s["loss"] for s in accum["settings"]} == {"clip", "siglip"}
    for s in accum["settings"]:
        assert set(s["ratios"]) == {"upstream@2", "replay@2", "default@2"}
        assert all(len(ts) == 1 and ts[0] > 0 for ts in s["times"].values())
    assert any("profile" in s for s in accum["settings"])  # the profile path runs in CI too
    for name in ("ours", "upstream"):
        run = sections["trainers"][name]
        assert run["rc"] == 0 and run["logged_steps"] > 0 and run["samples_per_s"] > 0, run["tail"][-2000:]
        assert 0 <= run["data_share"] <= 1
    text = (out / "gpu_check.md").read_text()
    assert "Smoke mode: tiny sizes on the CPU" in text and "| upstream | exit 0" in text


def test_an_existing_report_is_never_overwritten(smoke, tmp_path):
    proc, out = smoke
    before = (out / "gpu_check.md").read_text()
    again = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "run", "--smoke", "--out", str(out),
                            "--sections", "tests"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert again.returncode != 0 and "exists; pass another --out (nothing was overwritten)" in again.stderr
    assert (out / "gpu_check.md").read_text() == before


def test_console_figures_read_both_trainers_lines():
    from gpu_check import console_figures

    ours = ("Train Epoch: 0 [ 64/128 (50%)] Step: 1/2 Data (t): 0.500 Batch (t): 1.000, 64.0000/s, 1.0e+04 tok/s LR: 1\n"
            "Train Epoch: 0 [128/128 (100%)] Step: 2/2 Data (t): 0.100 Batch (t): 0.400, 160.000/s, 1.0e+04 tok/s LR: 1\n"
            "Train Epoch: 0 [128/128 (100%)] Step: 2/2 Data (t): 0.100 Batch (t): 0.600, 106.667/s, 1.0e+04 tok/s LR: 1\n")
    upstream = "Train Epoch: 0 [32/64 (50%)] Data (t): 0.010 Batch (t): 0.100, 320.000/s, 320.000/s/gpu LR: 0.1\n" * 2
    figures = console_figures(ours)
    assert figures["logged_steps"] == 3  # the first line (warm-up) is left out of the figures
    assert figures["samples_per_s"] == pytest.approx((160 + 106.667) / 2)
    assert figures["data_share"] == pytest.approx(0.2 / 1.0)
    assert console_figures(upstream)["samples_per_s"] == pytest.approx(320)
    assert console_figures("no console lines") == {"logged_steps": 0}


def test_prepare_lists_one_version_of_each_wheel():
    text = (ROOT / "benchmarks" / "gpu_check.sh").read_text()
    wheels = text.split("WHEELS=(", 1)[1].split(")", 1)[0].split()
    names = [w.split("==")[0] for w in wheels]
    assert all("==" in w for w in wheels) and len(set(names)) == len(names)
    assert {"open_clip_torch", "webdataset", "braceexpand", "simplejpeg", "timm"} <= set(names)
