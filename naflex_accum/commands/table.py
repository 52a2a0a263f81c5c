"""``naflex-accum table``: the full equivalence matrix, as printed in docs/equivalence.md.

Every split of AUDIT_SPLITS, every mode, CLIP and SigLIP, with and without
stochastic layers; exits 0 only if every row passes.
"""
import importlib
import json
import os
import sys
import time

import torch

from ..accum.scales import LOSS_SCALES
from ..errors import OneLineParser, UsageError
from ..upstream.audit import AUDIT_SPLITS, audit_case, default_task_factory, format_summary, format_table


def load_step(spec: str):
    """``MODULE:FUNCTION`` -> the callable (the step under audit)."""
    if os.getcwd() not in sys.path:  # as `python -m` would, so local modules can be audited
        sys.path.insert(0, os.getcwd())
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise UsageError(f"--step {spec!r}: expected MODULE:FUNCTION, e.g. open_clip_train.train:_train_step_eager")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UsageError(f"--step {spec!r}: cannot import {module_name!r} ({exc})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise UsageError(f"--step {spec!r}: {module_name} has no callable {attr!r}")
    return fn


def main(argv, prog="naflex-accum table", ends_process=False) -> int:
    parser = OneLineParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--step", default="naflex_accum:train_step_eager",
                        help="MODULE:FUNCTION of the step to audit (default: ours)")
    parser.add_argument("--json", action="store_true", help="print one JSON object per row")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    step = load_step(args.step)
    start = time.time()
    results = [audit_case(step, default_task_factory, loss, mode, split, stochastic)
               for loss in ("clip", "siglip") for stochastic in (False, True)
               for mode in LOSS_SCALES for split in AUDIT_SPLITS]
    if args.json:
        for r in results:
            print(json.dumps({**r.__dict__, "split": list(r.split), "passed": r.passed}))
    else:
        print(format_table(results))
        print()
        print(format_summary(results))
        worst = max(r.tower_rel_err for r in results)
        failed = sum(not r.passed for r in results)
        print(f"\n{len(results) - failed}/{len(results)} PASS; largest tower relative error {worst:.2e}; "
              f"{time.time() - start:.0f}s on the CPU (fp32, tiny random NaFlex CLIP/SigLIP)")
    return 0 if all(r.passed for r in results) else 1
