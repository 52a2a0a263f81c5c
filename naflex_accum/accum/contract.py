"""Upstream's task-and-step contract, generation by generation, and how the step speaks each one.

Invariant: the step reads task results and answers the loop only through a ``Contract``, so one step serves
every generation under upstream's one signature; a value not in the contract's form raises ``ContractError``
(one line) before the step uses it; ``contract=None`` follows each task result's form. The generations
(``losses``, ``report``): ``../shared/UPSTREAM_CONTRACT.md`` and docs/api.md, "Which contract a step speaks".
"""
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from ..errors import ContractError
from .window import LOGIT_KEYS


@dataclass(frozen=True)
class Contract:
    name: str
    span: str  # the upstream commits that have it
    report: bool  # task results are (losses, report) and the step returns a 4-tuple

    @property
    def task_form(self) -> str:
        return "a (losses, report) tuple of dicts" if self.report else "a losses dict alone"

    @property
    def step_form(self) -> str:
        return ("(losses, report, step_batch_size, accum_state)" if self.report
                else "(losses, step_batch_size, accum_state)")

    def describe(self) -> str:
        results = "(losses, report)" if self.report else "losses alone"
        return (f'contract "{self.name}" ({self.span}: task results {results}, the step returns '
                f'{4 if self.report else 3} values)')

    def step_result(self, losses: Dict, report: Dict, step_batch_size: int, accum_state) -> tuple:
        """What upstream's loop of this generation unpacks from the step."""
        if self.report:
            return losses, report, step_batch_size, accum_state
        if "logit_scale" in report:  # this generation's loop logs it from the losses
            losses = {**losses, "logit_scale": report["logit_scale"]}
        return losses, step_batch_size, accum_state


LOSSES = Contract("losses", "upstream main 5964c41 to 5f9ae12, 2026-05-22 to 06-13", report=False)
REPORT = Contract("report", "upstream main from 5f9ae12, 2026-06-14", report=True)
GENERATIONS = (REPORT, LOSSES)
KNOWN_FORMS = "(losses, report) [upstream from 2026-06-14] or losses alone [2026-05-22 to 2026-06-13]"


def describe_value(value) -> str:
    if isinstance(value, tuple):
        return f"a {len(value)}-tuple ({', '.join(type(v).__name__ for v in value)})"
    return f"a {type(value).__name__}"


def form_of(value) -> Optional[Contract]:
    """The generation whose form a task result has, or None."""
    if isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, dict) for v in value):
        return REPORT
    if isinstance(value, dict):
        return LOSSES
    return None


def task_result(value, where: str, contract: Optional[Contract],
                logits: Optional[Dict] = None) -> Tuple[Dict, Dict, Contract]:
    """``(losses, report, generation)`` from what ``where`` returned; ``contract``: the generation expected (None:
    the value's own form); ``logits``: what the step passed in, which a ``losses`` task does not report back."""
    found = form_of(value)
    if found is None or (contract is not None and found is not contract):
        expected = contract.task_form if contract is not None else KNOWN_FORMS
        installed = f", the form of the {contract.describe()} the step was installed for" if contract else ""
        raise ContractError(f"{where} returned {describe_value(value)}; expected {expected}{installed}. "
                            f"Upstream's task contract changed: run `naflex-accum verify` on this install.")
    if found.report:
        losses, report = value
        return losses, report, found
    report = {key: value[key] for key in LOGIT_KEYS if key in value}
    for key, logit in (logits or {}).items():
        report.setdefault(key, logit)
    return value, report, found


def split_result(result) -> Tuple[Dict, int]:
    """``(losses, step_batch_size)`` from a step's result of either generation (audits read only these)."""
    if not isinstance(result, tuple) or len(result) not in (3, 4):
        raise ContractError(f"the step returned {describe_value(result)}; expected "
                            f"{REPORT.step_form} or {LOSSES.step_form}.")
    return result[0], result[-2]
