"""``naflex-accum verify``: audit split invariance of the step training would use, on this install.

Invariant: the audited step is the one a run here would call: upstream's, looked up through its module while
``install()`` is in effect, on a tiny task of upstream's own factory; else ``naflex-accum train``'s on the
built-in one; ``--step`` any other, unpatched. A step that raises fails its row, never a traceback; exit 0 only
if every row passes. docs/upstream.md, "``naflex-accum verify``".
"""
import contextlib
import importlib
import json
import math
import time
import warnings
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, List

import torch

from ..accum.modes import ACCUM_MODES, DEFAULT_MODE, ENV_VAR, get_step, resolve_mode
from ..accum.scales import LOSS_SCALES
from ..errors import OneLineParser, PatchError
from ..helptext import DefaultsFormatter
from ..upstream import tiny_tasks
from ..upstream.audit import REFERENCE_BATCH_SIZE, VERIFY_SPLITS, audit_row, default_task_factory, format_table
from ..upstream.faults import describe as describe_faults, diagnose
from ..upstream.fingerprint import fingerprint, verified
from ..upstream.patch import (TARGET, TARGET_MODULE, TARGET_NAME, describe_contract, gate, import_target,
                              installed_step, open_clip_version, original_step, patched)
from ..upstream.tiny_tasks import LOSSES, STOCHASTIC_NOTE
from .table import load_step


@dataclass
class Target:
    step: Callable
    step_label: str
    make_task: Callable
    task_label: str
    context: Callable = contextlib.nullcontext  # entered around the audit (installs the patch)
    notes: List[str] = field(default_factory=list)
    upstream: bool = False  # the audited code is upstream's step (patched or not): fingerprint it
    diagnose: bool = False  # say which of upstream's three faults the audited step has (--step)
    facts: dict = field(default_factory=dict)  # found during the audit: contract, fingerprint


def upstream_facts(loss: str, step=None) -> dict:
    """The installed contract and the fingerprint of upstream's step (``step``, else the original) with the task."""
    facts = {}
    installed = installed_step()
    if installed is not None:
        facts["contract"] = describe_contract(installed.contract)
    original = step or original_step()
    if original is not None and tiny_tasks.available():
        import open_clip.task as tasks  # upstream main's alone (open_clip_torch 3.3.0 has none)

        task_class = getattr(tasks, tiny_tasks.TASK_CLASSES[loss])
        value = fingerprint(original, task_class)
        facts.update(fingerprint=value, fingerprint_task=task_class.__name__, verified_in_ci=verified(value))
    return facts


def _builtin_task(loss: str):
    if loss == "coca":
        return default_task_factory, "naflex_accum CocaTask around a built-in tiny random CoCa (dense 32 px images)"
    kind = "SigLipTask" if loss == "siglip" else "ClipTask"
    return default_task_factory, f"naflex_accum {kind} around the built-in tiny random NaFlex model (naflex-tiny)"


def _task_for(loss: str):
    if tiny_tasks.available():
        return tiny_tasks.task_factory, tiny_tasks.describe(loss)
    return _builtin_task(loss)


def _upstream_problem():
    """``(None, contract)`` when upstream's step can be patched here, else ``(PatchError, None)``."""
    try:
        contract, _ = gate(import_target(), original_step())
    except PatchError as exc:
        return exc, None
    return None, contract


def _through_module(module_name: str, attr: str) -> Callable:
    """A step that resolves ``module.attr`` at every call, as upstream's training loop does."""
    module = importlib.import_module(module_name)

    def step(task, batch, accum_state, optimizer, scaler, autocast, args):
        return getattr(module, attr)(task, batch, accum_state, optimizer, scaler, autocast, args)
    return step


def choose_target(step_spec, loss: str, mode=None) -> Target:
    if step_spec is not None:
        make_task, task_label = _task_for(loss)
        return Target(load_step(step_spec), f"{step_spec} (as given by --step; nothing patched)",
                      make_task, task_label, upstream=step_spec.startswith(f"{TARGET_MODULE}:"), diagnose=True)
    problem, contract = _upstream_problem()
    if problem is None:
        make_task, task_label = _task_for(loss)
        return Target(_through_module(TARGET_MODULE, TARGET_NAME),
                      f"{TARGET} with naflex_accum.install() in effect (accumulation mode {resolve_mode(mode)}: "
                      f"naflex_accum.{get_step(mode).__name__}), called through its module as train_one_epoch "
                      f"does", make_task, task_label,
                      context=partial(patched, mode=mode, contract=contract), upstream=True)  # probed just now
    make_task, task_label = _builtin_task(loss)
    if problem.missing:
        note = (f"open_clip_torch {problem.version} has no NaFlex training step ({TARGET} is missing), "
                f"so training goes through `naflex-accum train`, whose step is audited here.")
    else:
        note = (f"{TARGET} cannot be patched here (found {problem.found}), so `naflex-accum openclip` "
                f"would refuse to run; auditing the step of `naflex-accum train` instead.")
    step = get_step(mode)
    return Target(step, f"naflex_accum.{step.__name__}", make_task, task_label, notes=[note])


def run_audit(target: Target, loss: str):
    with target.context(), warnings.catch_warnings():
        # Upstream's step returns its loss still attached to the graph.
        warnings.filterwarnings("ignore", message="Converting a tensor with requires_grad")
        if target.upstream:
            # --step: the function audited; patched: the original that ours replaced
            target.facts.update(upstream_facts(loss, target.step if target.diagnose else None))
        results = [audit_row(target.step, target.make_task, loss, mode, split, stochastic)
                   for stochastic in (False, True) for mode in LOSS_SCALES for split in VERIFY_SPLITS]
    if target.diagnose:
        target.facts["fixes"] = diagnose(results, naflex=loss != "coca")
    return results


def _fact_lines(target: Target) -> List[str]:
    facts, lines = target.facts, []
    if "contract" in facts:
        lines.append(f"upstream: {facts['contract']}")
    if "fingerprint" in facts:
        where = facts["verified_in_ci"]
        lines.append(f"upstream fingerprint: {facts['fingerprint']} (its step and {facts['fingerprint_task']}."
                     f"compute_accum_loss): " + (f"verified in CI on {where}" if where else
                                                  "not among the upstream versions CI verified; the rows below "
                                                  "are the check"))
    if "fixes" in facts:
        lines.append(f"this step {describe_faults(facts['fixes'])}")
    return lines


def _span(results, key: str) -> str:
    vals = [r.logit_ratios[key] for r in results if key in r.logit_ratios]
    return f"{min(vals):.6f}..{max(vals):.6f}" if vals else "-"


def render_text(target: Target, loss: str, version: str, results, seconds: float) -> str:
    passed = sum(r.passed for r in results)
    errors = sorted({r.error for r in results if hasattr(r, "error")})
    dense = " (dense images: the NaFlex loss scale is 1)" if loss == "coca" else ""
    lines = [f"naflex-accum verify: open_clip_torch {version}, loss {loss}, CPU fp32",
             f"step: {target.step_label}",
             f"task: {target.task_label}",
             *[f"note: {n}" for n in target.notes],
             *_fact_lines(target),
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
                       "task": target.task_label, "notes": target.notes, **target.facts,
                       "reference_batch_size": REFERENCE_BATCH_SIZE,
                       "passed": all(r.passed for r in results), "seconds": round(seconds, 2), "rows": rows})


def build_parser(prog="naflex-accum verify") -> OneLineParser:
    parser = OneLineParser(prog=prog, description=__doc__.splitlines()[0], formatter_class=DefaultsFormatter)
    parser.add_argument("--loss", default="clip", choices=LOSSES,
                        help="loss of the tiny task: clip or siglip (NaFlex images), coca (dense images); each "
                             "runs on open_clip_torch 3.3.0 and on upstream open_clip main")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--step", metavar="MODULE:FUNCTION", default=None,
                        help="audit this function (upstream's signature) instead, unpatched; e.g. "
                             "open_clip_train.train:_train_step_eager shows upstream's bug (default: none: the step "
                             "training would use)")
    parser.add_argument("--accum-mode", choices=ACCUM_MODES, default=None,
                        help=f"accumulation mode to audit (default: ${ENV_VAR}, else {DEFAULT_MODE}, what "
                             f"training uses)")
    return parser


def main(argv, prog="naflex-accum verify", ends_process=False) -> int:
    args = build_parser(prog).parse_args(argv)

    torch.set_num_threads(1)
    target = choose_target(args.step, args.loss, args.accum_mode)
    start = time.time()
    results = run_audit(target, args.loss)
    render = render_json if args.json else render_text
    print(render(target, args.loss, open_clip_version(), results, time.time() - start))
    return 0 if all(r.passed for r in results) else 1
