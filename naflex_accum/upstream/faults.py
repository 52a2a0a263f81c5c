"""Which of upstream's three accumulation faults a step has, read off its audit rows.

Invariant: a fault is present only where a row that can show it fails that way, absent where such a row passes,
``None`` where no row tells: ``window-scale`` (a NaFlex ``linear``/``sqrt`` row), ``logit-once`` (a ``none`` row's
logit ratio), ``stochastic-replay`` (a ``none`` row with stochastic layers). docs/upstream.md.
"""
from typing import Dict, List, Optional

FAULTS = {
    "window-scale": "one loss scale per window",
    "logit-once": "the logit gradient counted once",
    "stochastic-replay": "stochastic layers replayed with the caching pass's masks",
}
# Audit rows that tell the three apart: (loss-scale mode, split, stochastic).
PROBE_ROWS = (("linear", (2, 1), False), ("none", (1, 2), False), ("none", (1, 2), True))


def _logits_off(row) -> bool:
    return any(abs(r - 1.0) > row.tol for r in row.logit_ratios.values())


def diagnose(rows: List, naflex: bool) -> Dict[str, Optional[bool]]:
    """fault -> True (the step gets it right), False (it has the fault), None (no row tells)."""
    ok = [r for r in rows if not hasattr(r, "error")]
    scaled = [r for r in ok if naflex and not r.stochastic and r.mode != "none"]
    plain = [r for r in ok if not r.stochastic and r.mode == "none"]
    stoch = [r for r in ok if r.stochastic and r.mode == "none"]
    return {
        "window-scale": all(r.tower_rel_err <= r.tol for r in scaled) if scaled else None,
        "logit-once": not any(_logits_off(r) for r in plain) if plain else None,
        "stochastic-replay": all(r.tower_rel_err <= r.tol for r in stoch) if stoch else None,
    }


def describe(found: Dict[str, Optional[bool]]) -> str:
    """What a step gets right and wrong of the three, in words, for its own audit."""
    parts = [f"{verdict}: {', '.join(FAULTS[k] for k, v in found.items() if v is value)}"
             for verdict, value in (("has", True), ("lacks", False), ("not shown", None))
             if any(v is value for v in found.values())]
    return "; ".join(parts)


def still_changed(found: Dict[str, Optional[bool]], mode: str) -> List[str]:
    """What the patch changes over upstream's own step: the fixes upstream lacks, then what ours adds."""
    changes = [FAULTS[k] for k, v in found.items() if v is not True]
    if mode == "cached-loss":
        changes.append("the window loss computed once, not once per microbatch")
    changes.append("the last microbatch's caching forward kept for its backward (one forward saved)")
    return changes
