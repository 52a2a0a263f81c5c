"""scripts/setup.sh and the Makefile: `make demo` (and `make table`) install the runtime dependencies alone,
`make test` the test extra; each installs once per change of pyproject.toml. A stand-in python records the pip
calls, so nothing is installed."""
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def venv(tmp_path):
    """A venv folder whose python writes its arguments to calls.txt."""
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    python = bin_dir / "python"
    python.write_text(f'#!/bin/sh\necho "$*" >> {tmp_path / "calls.txt"}\n')
    python.chmod(0o755)
    return tmp_path


def setup(venv, *args):
    subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh"), *args], check=True, timeout=60,
                   env={"PATH": "/usr/bin:/bin", "VENV": str(venv / "venv")})
    calls = venv / "calls.txt"
    lines = calls.read_text().splitlines() if calls.exists() else []
    calls.unlink(missing_ok=True)
    return lines


def test_demo_installs_the_runtime_and_test_the_test_extra(venv):
    first = setup(venv)
    assert first == ["-m pip install -q torch==2.14.1 torchvision==0.29.1", "-m pip install -q -e ."]
    assert setup(venv) == []  # installed already
    assert setup(venv, "test") == ["-m pip install -q torch==2.14.1 torchvision==0.29.1",
                                   "-m pip install -q -e .[test]"]
    assert setup(venv, "test") == [] and setup(venv) == []  # the test extra holds the runtime too


def test_a_changed_pyproject_installs_again(venv):
    setup(venv, "test")
    for stamp in (venv / "venv").glob(".naflex-accum-installed*"):
        subprocess.run(["touch", "-d", "2000-01-01", str(stamp)], check=True)
    assert setup(venv)[-1] == "-m pip install -q -e ."
    assert setup(venv, "test")[-1] == "-m pip install -q -e .[test]"


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
@pytest.mark.parametrize("target, setup_call", [("demo", "scripts/setup.sh\n"), ("table", "scripts/setup.sh\n"),
                                                 ("test", "scripts/setup.sh test\n")])
def test_each_make_target_sets_up_what_it_needs(target, setup_call):
    plan = subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert f"bash {setup_call}" in plan
