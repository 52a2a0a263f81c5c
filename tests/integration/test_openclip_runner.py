"""The upstream runner: ``naflex-accum openclip`` and ``python -m naflex_accum.openclip``.

On open_clip 3.3.0 it must stop with exit 2 and one line pointing to
``naflex-accum train``; with a stand-in of upstream's step (and a stand-in of
upstream's ``main``) it must hand ARGS over unchanged with our step in place,
and take the patch out afterwards.
"""

import subprocess
import sys

from unit.upstream.test_runner import ARGS, _one_line, _skip_unless_3_3  # noqa: F401 (fixtures)


def test_python_dash_m_on_3_3_exits_2(upstream_train):
    _skip_unless_3_3(upstream_train)
    out = subprocess.run([sys.executable, "-m", "naflex_accum.openclip", *ARGS],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stdout == ""
    assert "`naflex-accum train`" in _one_line(out.stderr)
