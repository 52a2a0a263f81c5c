"""scripts/setup.sh and the Makefile: `make demo` (and `make table`) install the runtime dependencies alone,
`make test` the test extra; each installs once per change of pyproject.toml; too little disk for torch is one line
before pip starts. A stand-in python records the pip calls, so nothing is installed."""
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def venv(tmp_path):
    """A venv folder whose python writes its pip arguments to calls.txt (``-c``: torch imports if torch.txt is
    there)."""
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    python = bin_dir / "python"
    python.write_text(f'#!/bin/sh\nif [ "$1" = -c ]; then test -f {tmp_path / "torch.txt"}; exit $?; fi\n'
                      f'echo "$*" >> {tmp_path / "calls.txt"}\n')
    python.chmod(0o755)
    return tmp_path


def setup(venv, *args, path="/usr/bin:/bin", check=True):
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh"), *args], check=check, timeout=60,
                          env={"PATH": path, "VENV": str(venv / "venv")}, capture_output=True, text=True)
    if not check:
        return proc
    calls = venv / "calls.txt"
    lines = calls.read_text().splitlines() if calls.exists() else []
    lines = [line for line in lines if line.startswith("-m pip")]  # not its compileall calls
    calls.unlink(missing_ok=True)
    return lines


def test_demo_installs_the_runtime_and_test_the_test_extra(venv):
    first = setup(venv)
    assert first == ["-m pip install -q --no-compile torch==2.14.1 torchvision==0.29.1",
                     "-m pip install -q --no-compile -e ."]
    assert setup(venv) == []  # installed already
    assert setup(venv, "test") == ["-m pip install -q --no-compile torch==2.14.1 torchvision==0.29.1",
                                   "-m pip install -q --no-compile -e .[test]"]
    assert setup(venv, "test") == [] and setup(venv) == []  # the test extra holds the runtime too


def test_a_changed_pyproject_installs_again(venv):
    setup(venv, "test")
    for stamp in (venv / "venv").glob(".naflex-accum-installed*"):
        subprocess.run(["touch", "-d", "2000-01-01", str(stamp)], check=True)
    assert setup(venv)[-1] == "-m pip install -q --no-compile -e ."
    assert setup(venv, "test")[-1] == "-m pip install -q --no-compile -e .[test]"


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
@pytest.mark.parametrize("target, setup_call", [("demo", "scripts/setup.sh\n"), ("table", "scripts/setup.sh\n"),
                                                 ("test", "scripts/setup.sh test\n")])
def test_each_make_target_sets_up_what_it_needs(target, setup_call):
    plan = subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert f"bash {setup_call}" in plan


@pytest.fixture
def small_disk(tmp_path):
    """A PATH whose ``df`` reports 1 GiB free."""
    bin_dir = tmp_path / "small-disk"
    bin_dir.mkdir()
    (bin_dir / "df").write_text("#!/bin/sh\necho 'Filesystem 1024-blocks Used Available Capacity Mounted on'\n"
                                "echo '/dev/x 9999999 0 1048576 1% /'\n")
    (bin_dir / "df").chmod(0o755)
    return f"{bin_dir}:/usr/bin:/bin"


def test_too_little_disk_for_torch_is_one_line_before_pip(venv, small_disk):
    proc = setup(venv, "test", path=small_disk, check=False)
    assert proc.returncode == 1 and not (venv / "calls.txt").exists()
    assert proc.stderr.strip().splitlines() == [
        f"setup: torch==2.14.1 torchvision==0.29.1 needs about 6 GB in {venv / 'venv'}; only 1024 MB are free "
        "there. Free some space and run this again."]


def test_the_disk_is_not_asked_once_torch_is_there(venv, small_disk):
    (venv / "torch.txt").write_text("")
    assert setup(venv, path=small_disk) == ["-m pip install -q --no-compile torch==2.14.1 torchvision==0.29.1",
                                            "-m pip install -q --no-compile -e ."]
