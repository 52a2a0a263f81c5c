"""``naflex-accum verify``: audit split invariance of the step training would use, on this install.

Invariant: the audited step is the one a run here would call. With upstream
open_clip main installed and matching the contract, that is
``open_clip_train.train._train_step_eager`` looked up through its module at
call time (as ``train_one_epoch`` does) while ``naflex_accum.install()`` is in
effect, on a tiny task built by upstream's own factory (CLIP, SigLIP or CoCa);
the patch is taken out again afterwards. Otherwise it is the step of
``naflex-accum train`` (the default accumulation mode, or ``--accum-mode``) on
the built-in tiny task. ``--step`` audits any other function of the same
signature, unpatched. A step that raises fails its row with the error, never a
traceback. Exit 0 only if every row passes.
"""
import contextlib
import json
import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, List

from ..errors import OneLineParser
from ..modes import DEFAULT_MODE, ENV_VAR
from ..modes import MODES as MODES_ACCUM
from ..scales import MODES
from ..upstream_tasks import LOSSES
from .table import load_step

# Uneven on purpose: an even split hides the per-replay-scale bug.
VERIFY_SPLITS = ((1, 2), (2, 1), (3, 5), (5, 2, 1))
REFERENCE_BATCH_SIZE = 4


@dataclass
class Target:
    step: Callable
    step_label: str
    make_task: Callable
    task_label: str
    context: Callable = contextlib.nullcontext  # entered around the audit (installs the patch)
    notes: List[str] = field(default_factory=list)


def _builtin_task(loss: str):
    from ..audit import default_task_factory

    if loss == "coca":
        return default_task_factory, "naflex_accum CocaTask around a built-in tiny random CoCa (dense 32 px images)"
    kind = "SigLipTask" if loss == "siglip" else "ClipTask"
    return default_task_factory, f"naflex_accum {kind} around the built-in tiny random NaFlex model (naflex-tiny)"


def _task_for(loss: str):
    from .. import upstream_tasks

    if upstream_tasks.available():
        return upstream_tasks.task_factory, upstream_tasks.describe(loss)
    return _builtin_task(loss)


def _upstream_problem():
    """None when upstream's step can be patched here, else the PatchError saying why not."""
    from ..patch import PatchError, contract_problem, import_target, open_clip_version, TARGET_NAME

    try:
        module = import_target()
    except PatchError as exc:
        return exc
    problem = contract_problem(getattr(module, TARGET_NAME, None))
    return None if problem is None else PatchError(open_clip_version(), problem)


def _through_module(module_name: str, attr: str) -> Callable:
    """A step that resolves ``module.attr`` at every call, as upstream's training loop does."""
    import importlib

    module = importlib.import_module(module_name)

    def step(task, batch, accum_state, optimizer, scaler, autocast, args):
        return getattr(module, attr)(task, batch, accum_state, optimizer, scaler, autocast, args)
    return step


def choose_target(step_spec, loss: str, mode=None) -> Target:
    from functools import partial

    from ..modes import get_step, resolve_mode
    from ..patch import TARGET, TARGET_MODULE, TARGET_NAME, patched

    if step_spec is not None:
        make_task, task_label = _task_for(loss)
        return Target(load_step(step_spec), f"{step_spec} (as given by --step; nothing patched)",
                      make_task, task_label)
    problem = _upstream_problem()
    if problem is None:
        make_task, task_label = _task_for(loss)
        return Target(_through_module(TARGET_MODULE, TARGET_NAME),
                      f"{TARGET} with naflex_accum.install() in effect (accumulation mode {resolve_mode(mode)}: "
                      f"naflex_accum.{get_step(mode).__name__}), called through its module as train_one_epoch "
                      f"does", make_task, task_label,
                      context=partial(patched, mode=mode))
    make_task, task_label = _builtin_task(loss)
    if problem.missing:
        note = (f"open_clip_torch {problem.version} has no NaFlex training step ({TARGET} is missing), "
                f"so training goes through `naflex-accum train`, whose step is audited here.")
    else:
        note = (f"{TARGET} cannot be patched here (found {problem.found}), so `naflex-accum openclip` "
                f"would refuse to run; auditing the step of `naflex-accum train` instead.")
    step = get_step(mode)
    return Target(step, f"naflex_accum.{step.__name__}", make_task, task_label, notes=[note])


def audit_row(step, make_task, loss: str, mode: str, split, stochastic: bool):
    """One row of the audit; a step (or reference) that raises gives a failed row with ``.error`` set."""
    from ..audit import AuditResult, audit_case, window_spec
    from ..scales import window_loss_scale

    try:
        return audit_case(step, make_task, loss, mode, split, stochastic,
                          reference_batch_size=REFERENCE_BATCH_SIZE)
    except Exception as exc:  # the audited step failed on this install: a FAIL row that says why
        message = " ".join(str(exc).split()) or "(no message)"
        naflex = window_spec(loss).images == "naflex"
        scale = window_loss_scale(list(split), REFERENCE_BATCH_SIZE, mode, naflex=naflex)
        row = AuditResult(loss, mode, tuple(split), stochastic, scale, math.inf, "")
        row.error = f"{type(exc).__name__}: {message}"
        return row


def run_audit(target: Target, loss: str):
    with target.context(), warnings.catch_warnings():
        # Upstream's step returns its loss still attached to the graph.
        warnings.filterwarnings("ignore", message="Converting a tensor with requires_grad")
        return [audit_row(target.step, target.make_task, loss, mode, split, stochastic)
                for stochastic in (False, True) for mode in MODES for split in VERIFY_SPLITS]


def _span(results, key: str) -> str:
    vals = [r.logit_ratios[key] for r in results if key in r.logit_ratios]
    return f"{min(vals):.6f}..{max(vals):.6f}" if vals else "-"


def render_text(target: Target, loss: str, version: str, results, seconds: float) -> str:
    from ..audit import format_table
    from ..upstream_tasks import STOCHASTIC_NOTE

    passed = sum(r.passed for r in results)
    errors = sorted({r.error for r in results if hasattr(r, "error")})
    dense = " (dense images: the NaFlex loss scale is 1)" if loss == "coca" else ""
    lines = [f"naflex-accum verify: open_clip_torch {version}, loss {loss}, CPU fp32",
             f"step: {target.step_label}",
             f"task: {target.task_label}",
             *[f"note: {n}" for n in target.notes],
             f"window: examples split into microbatches as shown; reference batch size (--batch-size) "
             f"{REFERENCE_BATCH_SIZE}{dense}; stoch = {STOCHASTIC_NOTE[loss]}",
             "", format_table(results), "",
             *[f"error in {sum(getattr(r, 'error', None) == e for r in results)} row(s): {e}" for e in errors],
             f"{passed}/{len(results)} PASS; largest tower relative error "
             f"{max(r.tower_rel_err for r in results):.2e}; logit_scale ratio {_span(results, 'logit_scale')}"
             + (f"; logit_bias ratio {_span(results, 'logit_bias')}" if loss == "siglip" else "")
             + f"; {seconds:.0f}s"]
    if passed < len(results) - sum(hasattr(r, "error") for r in results):
        lines.append("FAIL: this step's update depends on how a window is split, or counts the logit "
                     "parameters more than once (ratio != 1).")
    if errors:
        lines.append("FAIL: the step raised on this install (errors above).")
    return "\n".join(lines)


def render_json(target: Target, loss: str, version: str, results, seconds: float) -> str:
    def finite(value):
        return None if isinstance(value, float) and not math.isfinite(value) else value

    rows = [{**{k: finite(v) for k, v in r.__dict__.items()}, "split": list(r.split), "passed": r.passed}
            for r in results]
    return json.dumps({"open_clip_torch": version, "loss": loss, "step": target.step_label,
                       "task": target.task_label, "notes": target.notes,
                       "reference_batch_size": REFERENCE_BATCH_SIZE,
                       "passed": all(r.passed for r in results), "seconds": round(seconds, 2), "rows": rows})


def main(argv, prog="naflex-accum verify") -> int:
    parser = OneLineParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--loss", default="clip", choices=LOSSES,
                        help="loss of the tiny model (default: clip); coca needs upstream open_clip main")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--step", metavar="MODULE:FUNCTION", default=None,
                        help="audit this function (upstream's signature) instead, unpatched; e.g. "
                             "open_clip_train.train:_train_step_eager shows upstream's bug")
    parser.add_argument("--accum-mode", choices=MODES_ACCUM, default=None,
                        help=f"accumulation mode to audit (default: ${ENV_VAR}, else {DEFAULT_MODE}, what "
                             f"training uses)")
    args = parser.parse_args(argv)

    import torch

    from ..patch import open_clip_version

    torch.set_num_threads(1)
    target = choose_target(args.step, args.loss, args.accum_mode)
    start = time.time()
    results = run_audit(target, args.loss)
    render = render_json if args.json else render_text
    print(render(target, args.loss, open_clip_version(), results, time.time() - start))
    return 0 if all(r.passed for r in results) else 1
