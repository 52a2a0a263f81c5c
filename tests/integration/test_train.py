"""End to end: the built-in trainer on tiny demo shards (CPU, fp32, workers=0)."""

import subprocess
import sys

from unit.train.test_main import train  # noqa: F401 (fixtures)


def test_cli_subprocess_has_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "naflex_accum.cli", "train", "--train-data",
                           str(tmp_path / "missing-{0..3}.tar"), "--train-num-samples", "8",
                           "--logs", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr
