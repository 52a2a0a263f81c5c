"""Branches of a run: resuming an earlier checkpoint of a run folder moves the later ones aside, never deletes them.

Invariant: the top level of ``checkpoints/`` holds one line of the run, the one being trained, so
``--resume latest``, retention and the run's saves never meet a checkpoint further into the run than where
it was resumed; the others go to a new ``abandoned-N/`` (nothing overwritten). docs/long-runs.md,
"Going back: branches".
"""
import logging
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Tuple

from ...errors import UsageError, WriteError, writing
from .checkpoint import checkpoint_files, file_position, fsync_dir

log = logging.getLogger(__name__)

ABANDONED_RE = re.compile(r"^abandoned-(\d+)$")


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def further_than(folder: Path, where: Tuple[int, int, int], resumed: Path) -> List[Path]:
    """The checkpoints at the top level of ``folder`` further into the run than ``where`` (not ``resumed``)."""
    further = []
    for path in checkpoint_files(folder):
        if _same_file(path, resumed):
            continue
        try:
            if file_position(path) > tuple(where):
                further.append(path)
        except UsageError:
            continue  # unreadable: --resume latest skips it as well
    return sorted(further)


def _new_folder(folder: Path) -> Path:
    taken = [int(m.group(1)) for p in folder.iterdir() if (m := ABANDONED_RE.match(p.name))]
    n = max(taken, default=0) + 1
    while True:
        dest = folder / f"abandoned-{n}"
        try:
            dest.mkdir()
            return dest
        except FileExistsError:  # a file of that name: take the next number
            n += 1
        except OSError as exc:
            raise WriteError(dest, exc) from None


@dataclass
class Branch:
    """What starting a branch did: the files moved (old paths) and where to, and the resumed file linked in."""
    moved: List[Path] = field(default_factory=list)
    dest: Optional[Path] = None
    linked: Optional[Path] = None


def _name_for(where: Tuple[int, int, int]) -> str:
    global_step, epoch, step_in_epoch = where
    return f"step_{global_step}.pt" if step_in_epoch else f"epoch_{epoch}.pt"


def _stage(source: Path, target: Path) -> Path:
    """``source``'s content at a hidden temporary name next to ``target`` (a hard link, else, on another file
    system, a copy); a stale one is removed at the next start, like a save's."""
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        tmp.unlink(missing_ok=True)
        try:
            os.link(source, tmp)
        except OSError:
            shutil.copyfile(source, tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise WriteError(target, exc) from None
    return tmp


def abandoned_folders(folder: Path) -> List[Path]:
    return sorted(p for p in folder.iterdir() if ABANDONED_RE.match(p.name) and p.is_dir()) \
        if folder.is_dir() else []


def _move(doomed: List[Path], folder: Path) -> Path:
    dest, moved = _new_folder(folder), []
    for path in doomed:
        try:
            os.rename(path, dest / path.name)
        except OSError as exc:
            done = f"; moved before it: {', '.join(p.name for p in moved)}" if moved else ""
            raise UsageError(f"cannot move {path} aside to {dest}/ for the new branch: [Errno {exc.errno}] "
                             f"{exc.strerror}{done}") from None
        moved.append(path)
    fsync_dir(dest)
    return dest


def start_branch(folder: Path, resumed: Path, where: Tuple[int, int, int]) -> Branch:
    """Make ``folder``'s top level the line going on from ``resumed`` (at ``where``): the checkpoints further go
    to a new ``abandoned-N/``; a ``resumed`` from elsewhere is linked in and every top-level one goes."""
    present = checkpoint_files(folder)
    outside = not any(_same_file(path, resumed) for path in present)
    branch = Branch(moved=sorted(present) if outside else further_than(folder, where, resumed))
    # staged before anything moves: a failed link or copy leaves the folder as it was
    staged = _stage(resumed, folder / _name_for(where)) if outside else None
    if branch.moved:
        branch.dest = _move(branch.moved, folder)
        which = (f"which is not among the checkpoints of {folder}: a new branch of the run starts there. Moved its "
                 f"{len(branch.moved)} checkpoint(s)" if outside else
                 f"which is not the furthest checkpoint of {folder}: a new branch of the run starts there. Moved "
                 f"the {len(branch.moved)} checkpoint(s) further into the run")
        log.info(f"Resumed {resumed}, {which} ({', '.join(p.name for p in branch.moved)}) to {branch.dest}/; "
                 f"--resume {branch.dest}/NAME goes back to one of them")
    if staged is not None:
        branch.linked = folder / _name_for(where)
        with writing(branch.linked):
            os.replace(staged, branch.linked)
        log.info(f"Linked {resumed} in as {branch.linked}, the start of this line (--resume latest continues it)")
    fsync_dir(folder)
    return branch
