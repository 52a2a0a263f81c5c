"""A start of upstream's ``main`` that fails before its first step leaves nothing that would block its retry.

Invariant: such a start takes back from ``--logs/--name`` only what it proves it made (the folder absent when
setup began, and its log file the very inode this start's handler has open), only on the process that created
it: that log, on rank 0 ``params.txt`` and empty ``checkpoints/``/``tensorboard/``, then empty folders it
created; anything else keeps the folder, named in the line. A run that stepped is reported as before.
docs/upstream.md, "When upstream's main fails before its first step".
"""
import logging
import os
import traceback
from pathlib import Path
from typing import Optional

from torch.optim.optimizer import register_optimizer_step_post_hook

from .patch import step_calls

MAX_MESSAGE = 300  # characters of upstream's message in the line (a model list can run to pages)


def _file_handlers():
    return [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]


def _log_traceback(exc: BaseException) -> list:
    """The traceback into every log file (upstream's ``out.log``), not the console; the files written."""
    record = logging.getLogger("naflex_accum.openclip").makeRecord(
        "naflex_accum.openclip", logging.ERROR, __file__, 0, "upstream's main stopped before its first step",
        None, (type(exc), exc, exc.__traceback__))
    handlers = _file_handlers()
    for handler in handlers:
        handler.handle(record)
    return [h.baseFilename for h in handlers]


def _opened_in(folder: str, handlers) -> list:
    """The handlers whose file lies in ``folder`` and is still the very file their stream has open."""
    folder = os.path.abspath(folder)
    opened = []
    for handler in handlers:
        try:
            same = os.path.samestat(os.fstat(handler.stream.fileno()), os.stat(handler.baseFilename))
        except (AttributeError, ValueError, OSError):  # not opened (delay=True), closed, or its file gone
            same = False
        if same and os.path.dirname(handler.baseFilename) == folder:
            opened.append(handler)
    return opened


def _missing_levels(path: str) -> list:
    """The levels of ``path`` that are not there now, deepest first."""
    levels, path = [], os.path.normpath(path) if path else ""
    while path and path not in (os.curdir, os.sep) and not os.path.isdir(path):
        levels.append(path)
        path = os.path.dirname(path)
    return levels


def _removed(paths, rmdir=False) -> list:
    """The base names of ``paths`` that were removed (a folder only when empty)."""
    done = []
    for path in paths:
        try:
            (os.rmdir if rmdir else os.remove)(path)
            done.append(os.path.basename(path))
        except OSError:
            pass
    return done


def _holds(folder: str) -> str:
    names = sorted(os.listdir(folder), key=str.lower)
    shown = [name + ("/" if os.path.isdir(os.path.join(folder, name)) else "") for name in names[:3]]
    return ", ".join(shown) + (", ..." if len(names) > 3 else "")


def _error(exc: BaseException) -> str:
    message = " ".join(str(exc).split())
    if len(message) > MAX_MESSAGE:
        message = message[:MAX_MESSAGE - 3] + "..."
    text = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    frames = traceback.extract_tb(exc.__traceback__)
    if frames:  # where upstream raised it: its package folder and file
        path = Path(frames[-1].filename)
        text += f" ({path.parent.name}/{path.name}:{frames[-1].lineno})"
    return text


class StartWatch:
    """What one start of upstream's ``main`` created, and whether it has stepped (see the module's invariant)."""

    def __init__(self):
        self.args, self.named = None, False
        self.before = None  # the names under --logs when the start began; None: --logs was not there
        self.missing, self.handlers = [], ()  # the levels of --logs not there then; the log handlers there then
        self.armed = False
        self._steps, self._calls, self._hook = 0, 0, None

    def enter(self, args) -> None:
        """Upstream's ``main`` is about to set up its process group: its run folder is not made yet."""
        self.args, self.named = args, getattr(args, "name", None) is not None
        logs = self._logs()
        self.before = frozenset(os.listdir(logs)) if logs and os.path.isdir(logs) else None
        self.missing, self.handlers = _missing_levels(logs), frozenset(_file_handlers())

    def arm(self) -> None:
        """The self-check is over: a step from here on is the run's."""
        self._calls = step_calls()
        self._hook = register_optimizer_step_post_hook(self._stepped)
        self.armed = True

    def _stepped(self, optimizer, args, kwargs) -> None:
        self._steps += 1

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def before_first_step(self) -> bool:
        """Whether upstream's ``main`` has begun (its set-up seen) and no step has run."""
        if self.args is None:  # an upstream main whose set-up the runner cannot see: as it always was
            return False
        return not self.armed or (self._steps == 0 and step_calls() == self._calls)

    def _logs(self) -> str:
        return str(getattr(self.args, "logs", "") or "")

    def _folder(self) -> Optional[str]:
        name = getattr(self.args, "name", None)
        return os.path.join(self._logs(), name) if isinstance(name, str) and name and self._logs() else None

    def _creator(self) -> bool:
        import open_clip_train.distributed as upstream  # upstream's trainer: imported only once its main ran

        try:
            return bool(upstream.is_master(self.args, local=bool(getattr(self.args, "log_local", False))))
        except AttributeError:  # stopped inside its process group set-up: no rank yet, no folder either
            return False

    def settle(self, logged=()) -> str:
        """Remove the run folder if this start made it (the invariant); what became of it, in words ('' none)."""
        folder = self._folder()
        if folder is None or not os.path.isdir(folder) or not self._creator():
            return ""
        name = self.args.name
        if name in (".", "..") or Path(name).name != name:  # a path: which part this start made is not known
            return f"the run folder {folder} is kept (--name is a path, not a folder name)"
        if self.before is not None and name in self.before:
            kept = [path for path in logged if path.startswith(os.path.abspath(folder) + os.sep)]
            return (f"the run folder {folder} was there before this start and is kept"
                    + (f" (the traceback is in {kept[0]})" if kept else ""))
        opened = _opened_in(folder, [h for h in _file_handlers() if h not in self.handlers])
        if not opened:  # upstream refused it, or another start with this --name made it: not this start's
            return (f"the run folder {folder} is kept: it was made after this start began and this start did not "
                    f"open its log, so it may be another start's")
        gone = self._take_back(folder, opened)
        retry = ", so the same --name can start again" if self.named else ""
        if any(os.path.lexists(handler.baseFilename) for handler in opened):
            return f"the run folder {folder} could not be removed; remove it, or give another --name"
        if os.path.isdir(folder):
            return (f"the run folder {folder} is kept: it holds {_holds(folder)} (this start's {' and '.join(gone)} "
                    f"{'is' if len(gone) == 1 else 'are'} removed{retry})")
        _removed(self.missing, rmdir=True)
        return f"removed the run folder {folder} this start had created{retry}"

    def _take_back(self, folder: str, opened: list) -> list:
        """Remove what this start made in ``folder`` (the invariant); the names of the files removed."""
        for handler in opened:
            handler.close()
            logging.getLogger().removeHandler(handler)
        made = getattr(self.args, "rank", 0) == 0  # upstream's rank 0 writes params.txt and makes the folders
        gone = _removed([h.baseFilename for h in opened] + ([os.path.join(folder, "params.txt")] if made else []))
        _removed([os.path.join(folder, name) for name in ("checkpoints", "tensorboard") if made] + [folder], rmdir=True)
        return gone

    def failed(self, exc: BaseException) -> Optional[str]:
        """After upstream's ``main`` raised ``exc``: the one line, once the folder is settled; None to re-raise
        (a run that has stepped, as before; an exit or interrupt, after the folder is settled)."""
        if not self.before_first_step() or (isinstance(exc, SystemExit) and exc.code in (0, None)):
            return None
        what = self.settle(_log_traceback(exc))
        if not isinstance(exc, Exception):
            return None
        world, rank = getattr(self.args, "world_size", 1) or 1, getattr(self.args, "rank", 0)
        where = f" on rank {rank}" if isinstance(world, int) and world > 1 else ""
        return f"upstream's main stopped before its first step{where}: {_error(exc)}" + (f"; {what}" if what else "")
