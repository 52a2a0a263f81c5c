"""What step contract the installed upstream open_clip has, found out before the first window.

Invariant: ``probe()`` names a generation (``contract.GENERATIONS``) only when every part the step relies on
shows that one (the loop's unpacking, upstream's step, a task's results, the model's outputs); otherwise
``Probe.problem`` names the part in one line. It runs on the CPU under a forked random state.
"""
import ast
import contextlib
import inspect
import textwrap
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Dict, Optional, Tuple

import torch

from ..accum.contract import GENERATIONS, KNOWN_FORMS, LOSSES, REPORT, Contract, describe_value, form_of
from ..accum.window import LOGIT_KEYS
from . import tiny_tasks
from .audit import GradProbe, isolated_cpu, named_params, random_window, window_spec

STEP_NAME = "_train_step_eager"
LOOP_NAME = "train_one_epoch"
STEP_FORMS = {4: REPORT, 3: LOSSES}  # how many values each generation's loop unpacks from the step


@dataclass
class Probe:
    contract: Optional[Contract]
    problem: Optional[str] = None
    parts: Dict[str, str] = field(default_factory=dict)  # part -> what this install showed

    def summary(self) -> str:
        return "; ".join(f"{part}: {seen}" for part, seen in self.parts.items())


def loop_unpacks(train_module) -> Optional[Tuple[str, ...]]:
    """The names ``train_one_epoch`` unpacks the step's result into, read from its source; None if not found."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(getattr(train_module, LOOP_NAME))))
    except (AttributeError, TypeError, OSError, SyntaxError):
        return None
    assigns = [node for node in ast.walk(tree) if isinstance(node, ast.Assign)]
    held = set()  # names the call's result is first bound to (``result = _train_step_eager(...)``)
    for node in assigns:
        func = getattr(node.value, "func", None)
        if isinstance(node.value, ast.Call) and STEP_NAME in (getattr(func, "id", None), getattr(func, "attr", None)):
            for target in node.targets:
                if isinstance(target, ast.Tuple):
                    return tuple(ast.unparse(e) for e in target.elts)
                if isinstance(target, ast.Name):
                    held.add(target.id)
    for node in assigns:
        if isinstance(node.value, ast.Name) and node.value.id in held:
            for target in node.targets:
                if isinstance(target, ast.Tuple):
                    return tuple(ast.unparse(e) for e in target.elts)
    return None


def _step_form(result) -> Optional[Contract]:
    if not isinstance(result, tuple) or len(result) not in STEP_FORMS:
        return None
    contract = STEP_FORMS[len(result)]
    head = result[:2] if contract.report else result[:1]
    ok = all(isinstance(v, dict) for v in head) and isinstance(result[-2], int) and isinstance(result[-1], tuple)
    return contract if ok else None


def _model_problem(out, n: int) -> Optional[str]:
    if not isinstance(out, dict):
        return f"the model returned {describe_value(out)}, not a dict of outputs"
    if "logit_scale" not in out:
        return f"the model's outputs ({', '.join(out)}) have no 'logit_scale'"

    for key, value in out.items():
        if key not in LOGIT_KEYS and not (isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == n):
            return f"model output {key!r} is {describe_value(value)}, not a tensor with the batch ({n}) first"
    return None


def _upstream_args(**overrides):
    """Upstream's own defaults (its ``parse_args([])``) with ``overrides``: the args its step may read."""
    try:
        from open_clip_train.params import parse_args  # upstream's trainer: only when a step needs its args
        with contextlib.redirect_stdout(None), contextlib.redirect_stderr(None):
            args = parse_args([])
    except (Exception, SystemExit):  # any failure: the step reads only the few set below
        args = SimpleNamespace()
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def _run_parts(original, make_task, kind: str, parts: Dict[str, str]) -> Dict[str, Optional[Contract]]:
    """Run the tiny task and upstream's own step; what generation each part showed (None: no known one)."""
    task = make_task(kind, False)
    task.train()
    window = random_window((1, 2), seed=0, spec=window_spec(kind))
    name = type(task).__name__
    with torch.no_grad():
        outs = [task.trainable_module(**batch) for batch in window]
    problem = _model_problem(outs[0], 1)
    parts["model outputs"] = problem or ", ".join(outs[0])
    if problem:
        return {"model": None}
    forms = {}
    with torch.no_grad():
        value = task(window[0])
        forms[f"{name}(batch)"] = value
        inputs = {k: torch.cat([o[k] for o in outs]) for k in outs[0] if k not in LOGIT_KEYS}
        value = task.compute_accum_loss(inputs, {k: outs[-1][k] for k in LOGIT_KEYS if k in outs[-1]}, window)
        forms[f"{name}.compute_accum_loss"] = value
    found = {}
    for part, value in forms.items():
        found[part] = form_of(value)
        parts[part] = f"returns {describe_value(value)}"
    args = _upstream_args(accum_freq=2, batch_size=4, naflex_loss_scale="none", grad_clip_norm=None,
                          device="cpu", precision="fp32")
    try:
        state, result = ([], {}), None
        for batch in window:
            result = original(task, batch, state, GradProbe(named_params(task)), None, contextlib.nullcontext, args)
        found["upstream's own step"] = _step_form(result)
        parts["upstream's own step"] = f"returns {describe_value(result)} for a full window"
    except Exception as exc:  # the loop's source can still say what it unpacks
        parts["upstream's own step"] = f"raised {type(exc).__name__}: {' '.join(str(exc).split())[:160]}"
    return found


def probe(train_module, original, kind: str = "clip", make_task=None) -> Probe:
    """Probe ``original`` (upstream's step) in ``train_module`` with a tiny task of ``kind``."""
    parts: Dict[str, str] = {}
    unpacked = loop_unpacks(train_module)
    found: Dict[str, Optional[Contract]] = {}
    if unpacked is not None:
        found[LOOP_NAME] = STEP_FORMS.get(len(unpacked))
        parts[LOOP_NAME] = f"unpacks {len(unpacked)} values ({', '.join(unpacked)}) from {STEP_NAME}"
    else:
        parts[LOOP_NAME] = f"its unpacking of {STEP_NAME} not found in its source"
    if make_task is None:
        if not tiny_tasks.available():
            return Probe(None, "open_clip.task has no CLIPTask, SigLIPTask and CoCaTask to probe the contract with",
                         parts)
        make_task = tiny_tasks.task_factory
    try:
        with isolated_cpu():
            found.update(_run_parts(original, make_task, kind, parts))
    except Exception as exc:
        return Probe(None, f"a tiny upstream {kind} task could not be run to probe the contract "
                           f"({type(exc).__name__}: {' '.join(str(exc).split())[:200]})", parts)
    return _decide(found, parts)


def _decide(found: Dict[str, Optional[Contract]], parts: Dict[str, str]) -> Probe:
    if "model" in found:
        return Probe(None, f"{parts['model outputs']}; the step caches a dict of outputs with 'logit_scale'", parts)
    unknown = [part for part, contract in found.items() if contract is None]
    if unknown:
        part = unknown[0]
        known = (f"{REPORT.step_form} or {LOSSES.step_form}" if part in (LOOP_NAME, "upstream's own step")
                 else KNOWN_FORMS)
        return Probe(None, f"{part} {parts[part]}; the fix knows {known}", parts)
    own = "upstream's own step"
    if LOOP_NAME not in found and own not in found:
        return Probe(None, f"neither {LOOP_NAME}'s source nor upstream's own step shows what the loop unpacks "
                           f"(the step {parts.get(own, 'did not run')})", parts)
    seen: Dict[str, list] = {}
    for part, contract in found.items():
        seen.setdefault(contract.name, []).append(part)
    if len(seen) > 1:
        views = "; ".join(f"{', '.join(names)} {'speaks' if len(names) == 1 else 'speak'} {name!r}"
                          for name, names in seen.items())
        return Probe(None, f"the parts of the contract disagree ({views})", parts)
    contract = next(iter(found.values()))
    assert contract in GENERATIONS
    return Probe(contract, None, parts)
