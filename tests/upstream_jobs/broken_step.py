"""``python -m naflex_accum.openclip ARGS`` with the fixed step broken on some ranks, to see the self-check stop it.

    [torchrun ...] broken_step.py ARGS      (upstream's src first on PYTHONPATH)

$BROKEN_RANKS (comma-separated global ranks, default none) get a reference bug
($BUG, a key of ``naflex_accum.testing.bugs.BUGS``, default per-replay-scale)
in place of the step the patch installs; the others get the fixed step.
The runner's refusal of DDP on the CPU is lifted here, so that two CPU ranks
reach upstream's process group and the self-check's agreement over it
(upstream's main then stops at its DDP wrap, after the check and the record).
"""
import os
import sys

from naflex_accum.openclip import main
from naflex_accum.testing.bugs import bug_step
from naflex_accum.upstream import patch, preflight

broken = {int(r) for r in os.environ.get("BROKEN_RANKS", "").split(",") if r.strip()}
if int(os.environ.get("RANK", "0")) in broken:
    patch.make_step = lambda mode, contract: bug_step(os.environ.get("BUG", "per-replay-scale"), mode)

preflight.CHECKS = tuple(check for check in preflight.CHECKS if check.__name__ != "_ddp_on_cpu")
sys.exit(main(sys.argv[1:]))
