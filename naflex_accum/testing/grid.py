"""The equivalence grids beyond ``naflex-accum table``: CoCa, a task that rewrites its inputs, grad
checkpointing, and bf16 autocast, for both modes (what docs/equivalence.md shows).

    python -m naflex_accum.testing.grid          # under a minute on two idle CPU cores

Exits 0 only if every row passes (fp32 rows at 1e-5, bf16 rows at 5e-2).
"""
import functools
import sys
import time

import torch

from ..accum.cached_loss import cached_loss_step
from ..accum.replay import replay_step
from ..accum.scales import LOSS_SCALES
from ..upstream.audit import AUDIT_SPLITS, audit_case, default_task_factory, format_summary
from .mutating_task import make_mutating_task

BF16_TOL = 5e-2


def grid(step, label, make_task, loss, modes=None, stochastic=(False, True), tol=1e-5, **kw):
    rows = [audit_case(step, make_task, loss, mode, split, s, tol=tol, **kw)
            for s in stochastic for mode in (modes or LOSS_SCALES) for split in AUDIT_SPLITS]
    for r in rows:
        r.loss = label
    return rows


def report(title, rows) -> int:
    print(f"\n{title}: {sum(r.passed for r in rows)}/{len(rows)} PASS; largest tower relative error "
          f"{max(r.tower_rel_err for r in rows):.2e}")
    print(format_summary(rows))
    return sum(not r.passed for r in rows)


def main() -> int:
    torch.set_num_threads(1)
    bf16 = functools.partial(torch.autocast, "cpu", dtype=torch.bfloat16)
    checkpointed = functools.partial(default_task_factory, grad_checkpointing=True)
    failed, start = 0, time.time()
    for name, step in (("cached-loss (default)", cached_loss_step), ("replay", replay_step)):
        rows = (grid(step, "coca", default_task_factory, "coca")
                + grid(step, "clip, mutating task", make_mutating_task, "clip")
                + grid(step, "siglip, mutating task", make_mutating_task, "siglip")
                + grid(step, "clip, grad checkpointing", checkpointed, "clip", ("linear",), (True,))
                + grid(step, "siglip, grad checkpointing", checkpointed, "siglip", ("linear",), (True,)))
        failed += report(f"{name}, fp32", rows)
        rows = [r for loss in ("clip", "siglip", "coca")
                for r in grid(step, f"{loss}, bf16", default_task_factory, loss, ("linear",), tol=BF16_TOL,
                              autocast=bf16)]
        failed += report(f"{name}, bf16 autocast against a bf16 full-batch backward (tolerance {BF16_TOL})", rows)
    print(f"\n{'all rows PASS' if not failed else f'{failed} row(s) FAIL'}; {time.time() - start:.0f}s on the CPU")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
