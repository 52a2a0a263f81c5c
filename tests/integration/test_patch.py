"""install / uninstall / patched / is_installed against open_clip 3.3.0 and stand-ins of upstream's step.

No upstream open_clip main here: open_clip 3.3.0 has ``open_clip_train.train``
without ``_train_step_eager``, so the tests put stand-ins of upstream's
signature on it (restored after each test by the fixtures).
"""

import subprocess
import sys
import textwrap


def test_importing_the_package_patches_and_imports_nothing_upstream():
    code = textwrap.dedent("""
        import sys
        import naflex_accum, naflex_accum.upstream.patch
        assert not naflex_accum.is_installed()
        assert "open_clip_train.train" not in sys.modules, "import pulled in open_clip_train"
        print("clean")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "clean" in out.stdout, out.stderr
