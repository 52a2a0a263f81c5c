"""The runner's check before upstream trains: the installed step audited on this run's own task.

Invariant: unless ``NAFLEX_ACCUM_VERIFY=0`` (recorded), a run trains only after every rank audited the
installed step, called as ``train_one_epoch`` calls it, on a tiny CPU model of this run's task from upstream's
own factories, and every rank passed with one fingerprint; else every rank stops with one line. The CPU random
state and thread count are left as they were. docs/upstream.md, "The self-check before every run".
"""
import os
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

import torch.distributed as dist

from ..errors import SelfCheckFailed, UsageError
from . import faults, tiny_tasks
from .audit import VERIFY_SPLITS, audit_row, describe_row, isolated_cpu
from .fingerprint import describe as describe_fingerprint, fingerprint
from .patch import describe_contract, installed_step, open_clip_version, original_step

ENV_VAR = "NAFLEX_ACCUM_VERIFY"


@dataclass
class Outcome:
    rank: int
    task: str = ""
    rows: int = 0
    failed: List[str] = field(default_factory=list)
    error: Optional[str] = None  # the check itself could not run
    seconds: float = 0.0
    fingerprint: str = ""
    upstream: Dict[str, Optional[bool]] = field(default_factory=dict)  # faults.diagnose of upstream's own step

    @property
    def passed(self) -> bool:
        return self.error is None and not self.failed


def enabled() -> bool:
    value = os.environ.get(ENV_VAR, "1").strip()
    if value not in ("0", "1", ""):
        raise UsageError(f"{ENV_VAR}={value}: use 1 (the default) to audit the step before training, "
                         f"0 to skip the audit")
    return value != "0"


def _through_module():
    import open_clip_train.train as module  # upstream's trainer: imported only when the runner checks it

    def step(task, batch, accum_state, optimizer, scaler, autocast, args):
        return module._train_step_eager(task, batch, accum_state, optimizer, scaler, autocast, args)
    return step


def _audit(args, original) -> Outcome:
    outcome = Outcome(rank=getattr(args, "rank", 0) or 0)
    kind, why = tiny_tasks.run_kind(args)
    if kind is None:
        outcome.error = why
        return outcome
    make_task = tiny_tasks.run_task_factory(args, kind)
    task_class = type(make_task(kind, False))
    outcome.task, outcome.fingerprint = task_class.__name__, fingerprint(original, task_class)
    if outcome.task != tiny_tasks.TASK_CLASSES[kind]:
        outcome.error = (f"this run trains {outcome.task}, which naflex-accum does not verify (it verifies "
                         f"{', '.join(tiny_tasks.TASK_CLASSES.values())})")
        return outcome
    mode = getattr(args, "naflex_loss_scale", None) or "none"
    step = _through_module()
    rows = [audit_row(step, make_task, kind, mode, split, stochastic)
            for stochastic in (False, True) for split in VERIFY_SPLITS]
    outcome.rows, outcome.failed = len(rows), [describe_row(r) for r in rows if not r.passed]
    own = [audit_row(original, make_task, kind, m, split, stochastic) for m, split, stochastic in faults.PROBE_ROWS]
    outcome.upstream = faults.diagnose(own, naflex=kind != "coca")
    return outcome


def run(args, original) -> Outcome:
    """This rank's audit of the installed step on ``args``'s task; ``original`` is upstream's own step."""
    start = time.time()
    try:
        with isolated_cpu(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Converting a tensor with requires_grad")  # upstream's step
            outcome = _audit(args, original)
    except Exception as exc:  # building the tiny task failed: the check could not run
        outcome = Outcome(rank=getattr(args, "rank", 0) or 0,
                          error=f"the tiny task could not be built ({type(exc).__name__}: {' '.join(str(exc).split())})")
    outcome.seconds = time.time() - start
    return outcome


def agree(outcome: Outcome) -> List[Outcome]:
    """Every rank's outcome, gathered over the process group upstream set up (just this one without)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [outcome]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, asdict(outcome))
    return [Outcome(**o) for o in gathered]


def verdict(outcomes: List[Outcome]) -> Optional[str]:
    """None when every rank passed with the same upstream code, else the one-line reason to stop."""
    for o in outcomes:
        if o.error is not None:
            return f"rank {o.rank}: {o.error}"
        if o.failed:
            return f"rank {o.rank}: {len(o.failed)} of {o.rows} rows failed; the first: {o.failed[0]}"
    prints = {o.fingerprint for o in outcomes}
    if len(prints) > 1:
        seen = ", ".join(f"rank {o.rank} {o.fingerprint}" for o in outcomes)
        return f"the ranks run different upstream code ({seen}): install the same open_clip on every node"
    return None


def describe(outcomes: List[Outcome], mode: str, loss_scale: str) -> str:
    o = outcomes[0]
    ranks = f"all {len(outcomes)} ranks" if len(outcomes) > 1 else "1 rank"
    return (f"PASS {o.rows}/{o.rows} rows ({o.task}, --naflex-loss-scale {loss_scale or 'none'}, accumulation "
            f"mode {mode}, tiny CPU model) on {ranks}, {max(x.seconds for x in outcomes):.1f} s")


def fail_line(reason: str) -> str:
    return (f"the fixed step failed its check on this run's task before training ({reason}); nothing was "
            f"trained. Run `naflex-accum verify` for the full table; {ENV_VAR}=0 skips the check.")


def _task_class(args):
    kind, _ = tiny_tasks.run_kind(args)
    try:
        import open_clip.task as tasks  # upstream main's alone (open_clip_torch 3.3.0 has none)
        return getattr(tasks, tiny_tasks.TASK_CLASSES[kind or "clip"])
    except (ImportError, AttributeError):
        return None


def _stop(reason: str):
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()  # every rank stops here, after the same verdict
    raise SelfCheckFailed(fail_line(reason))


def _record_upstream(args) -> None:
    step = installed_step()
    args.naflex_accum_upstream = (f"open_clip {open_clip_version()}, "
                                  f"{describe_contract(step.contract if step is not None else None)}")


def record_unused(args, why: str) -> List[str]:
    """Record on ``args`` (params.txt) that this run's loop never calls the step, so nothing was audited."""
    _record_upstream(args)
    args.naflex_accum_verify = f"not run: this run never calls the fixed step ({why})"
    return [f"upstream: {args.naflex_accum_upstream}", f"self-check: {args.naflex_accum_verify}"]


def check_run(args, mode: str) -> List[str]:
    """Check this run, record it on ``args``, return out.log's lines; ``SelfCheckFailed`` on every rank if any fails."""
    original = original_step()
    _record_upstream(args)
    loss_scale = getattr(args, "naflex_loss_scale", None) or "none"
    if not enabled():
        task_class = _task_class(args)
        args.naflex_accum_fingerprint = describe_fingerprint(fingerprint(original, task_class),
                                                             getattr(task_class, "__name__", "?"))
        args.naflex_accum_verify = f"skipped ({ENV_VAR}=0)"
        return [f"upstream: {args.naflex_accum_upstream}; fingerprint {args.naflex_accum_fingerprint}",
                f"self-check: skipped ({ENV_VAR}=0): the step was not audited on this run's task"]
    outcomes = agree(run(args, original))
    reason = verdict(outcomes)
    if reason is not None:
        _stop(reason)
    mine = outcomes[0]
    args.naflex_accum_fingerprint = describe_fingerprint(mine.fingerprint, mine.task)
    args.naflex_accum_verify = describe(outcomes, mode, loss_scale)
    args.naflex_accum_changes = "; ".join(faults.still_changed(mine.upstream, mode))
    return [f"upstream: {args.naflex_accum_upstream}; fingerprint {args.naflex_accum_fingerprint}",
            f"self-check: {args.naflex_accum_verify}",
            f"upstream's own step, audited the same way: {faults.describe(mine.upstream)}. The patch changes: "
            f"{args.naflex_accum_changes}"]
