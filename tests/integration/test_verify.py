"""``naflex-accum verify``: exit 0 on our step, non-zero on a buggy one, and it audits what training would use.

Without upstream installed (open_clip 3.3.0) the default audits the trainer's
default step (``naflex_accum.cached_loss_step``) on the built-in task; with a stand-in of
upstream's step on ``open_clip_train.train`` it audits that step through the
module with the patch in effect, and leaves the stand-in in place afterwards.
"""

import pytest
from unit.upstream.test_verify import ROWS, run  # noqa: F401 (fixtures)
from upstream_stand_in import NAME

from naflex_accum.commands import verify


def test_verify_passes_on_our_step(upstream_train, capsys):
    if hasattr(upstream_train, NAME):
        pytest.skip("this open_clip has _train_step_eager: verify would audit the patched upstream step")
    code, out, _ = run(capsys)
    assert code == 0, out
    assert "step: naflex_accum.cached_loss_step" in out
    assert "has no NaFlex training step" in out  # says why it is not upstream's step
    header = next(line for line in out.splitlines() if line.startswith("loss "))
    for column in ("mode", "split", "scale", "tower rel err", "logit_scale", "result"):
        assert column in header
    assert f"{ROWS}/{ROWS} PASS" in out and "FAIL" not in out
    for split in verify.VERIFY_SPLITS:
        assert str(list(split)) in out
