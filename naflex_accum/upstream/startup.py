"""A start of upstream's ``main`` that fails before its first step leaves nothing that would block its retry.

Invariant: when upstream's ``main`` stops before its first step (an exception,
its "refused to start" -1, an exit or an interrupt), its run folder
``--logs/--name`` is removed only if all of these hold: this process is the one
upstream's ``main`` creates it on (its ``is_master(args, local=args.log_local)``);
``--name`` is a plain folder name that was not under ``--logs`` when upstream's
``main`` began setting up its process group (before it names and creates the
folder); no step ran since the self-check (no optimizer stepped, the fixed step
was not called); and nothing lies under its ``checkpoints/``. ``--logs`` goes
too when this start created it and it is empty then. Everything else stays as
it was: a folder from an earlier start (its ``out.log`` gets the traceback), and
all of a run that has stepped, whose failure is reported as before. ``failed``
words upstream's error in one line, with what became of the folder.
"""
import logging
import os
import shutil
import traceback
from pathlib import Path
from typing import Optional

from torch.optim.optimizer import register_optimizer_step_post_hook

from .patch import step_calls

MAX_MESSAGE = 300  # characters of upstream's message in the line (a model list can run to pages)


def _has_files(folder: str) -> bool:
    return any(files for _, _, files in os.walk(folder))


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


def _close_logs_under(folder: str) -> None:
    inside = os.path.abspath(folder) + os.sep
    for handler in _file_handlers():
        if handler.baseFilename.startswith(inside):
            handler.close()
            logging.getLogger().removeHandler(handler)


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
        self.armed = False
        self._steps, self._calls, self._hook = 0, 0, None

    def enter(self, args) -> None:
        """Upstream's ``main`` is about to set up its process group: its run folder is not made yet."""
        self.args, self.named = args, getattr(args, "name", None) is not None
        logs = self._logs()
        self.before = frozenset(os.listdir(logs)) if logs and os.path.isdir(logs) else None

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
        if _has_files(os.path.join(folder, "checkpoints")):
            return f"the run folder {folder} is kept: it holds checkpoints"
        _close_logs_under(folder)
        shutil.rmtree(folder, ignore_errors=True)
        if os.path.exists(folder):
            return f"the run folder {folder} could not be removed; remove it, or give another --name"
        if self.before is None:
            try:  # --logs too, when this start made it and nothing else is in it
                os.rmdir(self._logs())
            except OSError:
                pass
        retry = ", so the same --name can start again" if self.named else ""
        return f"removed the run folder {folder} this start had created{retry}"

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
