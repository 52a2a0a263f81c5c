"""The public surface: every name docs/api.md documents imports, the package's face stays where users find it,
and importing it patches nothing."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_importing_patches_nothing():
    code = ("import sys, naflex_accum, naflex_accum.accum, naflex_accum.upstream, naflex_accum.data, "
            "naflex_accum.openclip, naflex_accum.cli; "
            "print(sorted(m for m in sys.modules if m.startswith('open_clip_train')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"  # upstream's trainer is not even imported, let alone patched
