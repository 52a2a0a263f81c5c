"""``--report-to``: which metric sinks a run writes to (open_clip's values), and the wandb run.

Invariants: wandb named without the package is a ``UsageError`` at parsing; the wandb run is rank 0's, its id
derived from the folder name, so a resume logs into the same run (files under ``logs/NAME/wandb``).
"""
import re
from typing import FrozenSet, Optional

from ...errors import UsageError, first_line

SINKS = ("tensorboard", "wandb")
INSTALL = "pip install 'naflex-accum[wandb]'"


def sinks(value: Optional[str]) -> FrozenSet[str]:
    """The sinks ``--report-to VALUE`` names; a UsageError for anything else."""
    names = {part.strip() for part in (value or "").split(",") if part.strip()}
    names.discard("none")
    if "all" in names:
        names = (names - {"all"}) | set(SINKS)
    unknown = sorted(names - set(SINKS))
    if unknown:
        raise UsageError(f"--report-to {value!r}: {', '.join(unknown)} is not a sink here; valid values are "
                         f"'tensorboard', 'wandb', 'all', a comma-joined list of them, or '' / 'none'")
    return frozenset(names)


def check_wandb(value: Optional[str]) -> None:
    """Refuse a wandb sink when wandb is not installed (before anything is written)."""
    if "wandb" not in sinks(value):
        return
    try:
        import wandb  # noqa: F401  (optional: installed only by users who log to wandb)
    except ImportError:
        raise UsageError(f"--report-to {value}: wandb is not installed; install it with {INSTALL}, or "
                         f"drop wandb from --report-to") from None


def run_id(name: str) -> str:
    """A wandb run id for run folder ``name``: the characters wandb refuses in an id become '-'."""
    return re.sub(r"[^A-Za-z0-9_.\-]", "-", name)[:128]


def open_wandb(args, root):
    """Rank 0's wandb run for run folder ``root`` (a new one, or the folder's own on ``--resume``)."""
    import wandb  # optional: installed only by users who log to wandb

    folder = root / "wandb"
    folder.mkdir(exist_ok=True)
    try:
        return wandb.init(project=args.wandb_project_name, name=args.name, id=run_id(args.name),
                          notes=args.wandb_notes or None, dir=str(root), resume="allow",
                          config={k: v for k, v in vars(args).items() if _plain(v)},
                          settings=wandb.Settings(console="off"))
    except Exception as exc:  # no API key, no network, a refused project: wandb raises many types
        raise UsageError(f"--report-to wandb: wandb.init failed ({first_line(exc, named=True)}); run "
                         f"`wandb login`, or set WANDB_MODE=offline and `wandb sync` {folder} later") from None


def _plain(value) -> bool:
    return value is None or isinstance(value, (str, int, float, bool, list, tuple))
