"""Checkpoint files: atomic writes, safe and verified reads, the newest loadable one, retention.

Invariants: a file under a checkpoint name is complete (temporary file, fsync, ``os.replace``); bytes that
differ from the zip's CRC-32s are named as damage; reading never runs code from the file; ``--resume latest``
takes the top-level checkpoint furthest into the run that loads completely; retention never deletes the file
just written. Names: ``epoch_K.pt``, ``epoch_latest.pt``, ``step_G.pt``. docs/long-runs.md,
"What is saved when" and "Reading checkpoints safely".
"""
import importlib.util
import logging
import os
import pickle
import re
import shlex
import sys
import types
import zipfile
from pathlib import Path
from typing import List, Optional, Set, Tuple

import torch
from safetensors.torch import load_file

from ...data import held_worker_failures
from ...errors import UsageError, WriteError, first_line

log = logging.getLogger(__name__)

EPOCH_RE = re.compile(r"^epoch_(\d+)\.pt$")
STEP_RE = re.compile(r"^step_(\d+)\.pt$")
MOST_RECENT = "epoch_latest.pt"
TEMP_RE = re.compile(r"^\..+\.tmp-\d+$")
# What a payload may hold beyond torch.load(weights_only=True)'s defaults; ours needs nothing more.
ALLOWED_GLOBALS: tuple = ()
REQUIRED_KEYS = ("epoch", "state_dict", "optimizer")
ZIP_START = b"PK\x03\x04"  # torch.save's format since torch 1.6
PICKLE_START = b"\x80"  # torch.save's legacy format: a pickle of protocol 2 or later
OLD_CHECKSUM = "checksum"  # a second CRC-32 pass over the payload that older versions wrote: not state


class _Writer:
    """A file for ``torch.save`` that writes every byte or keeps the OS error (torch says ``unexpected pos``)."""

    def __init__(self, fd: int):
        self.fd, self.error = fd, None

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        size = len(view)
        try:
            while view:
                view = view[os.write(self.fd, view):]
        except OSError as exc:
            self.error = self.error or exc
            raise
        return size

    def flush(self) -> None:
        pass


def save_checkpoint(path: Path, payload: dict) -> None:
    """Write ``payload`` atomically to ``path``."""
    with held_worker_failures():  # a loader worker dying meanwhile fails the run after the write, not inside it
        _save(Path(path), payload)


def _save(path: Path, payload: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        writer = _Writer(fd)
        try:
            torch.save(payload, writer)
            os.fsync(fd)
        except RuntimeError as exc:
            # torch's zip writer, closing after a failed write, says "unexpected pos": say what stopped it
            if isinstance(exc.__context__, KeyboardInterrupt):  # Ctrl-C: one line, not this error (``interrupt``)
                raise exc.__context__ from None
            if writer.error is None:
                raise
            raise writer.error from None
        finally:
            os.close(fd)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise WriteError(path, exc) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def fsync_dir(folder: Path) -> None:
    """Make a rename itself durable (a node crash right after a save keeps the new file)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some network file systems refuse fsync on a directory; the data itself is synced
    finally:
        os.close(fd)


def _refused_global(exc: Exception) -> Optional[str]:
    # torch's two wordings: a global outside the allow-list, and one from a blocked module (os, subprocess, ...)
    m = re.search(r"(?:Unsupported global: GLOBAL|unsupported GLOBAL) (\S+?)(?: was| whose|$|\s)", str(exc))
    return m.group(1) if m else None


def _provided(name: str) -> bool:
    """Whether an installed module provides global ``name`` (``module.attribute``), judged without importing
    anything new: unknown when its module is not imported yet (then True, so a refusal stays a refusal)."""
    parts = name.split(".")
    if not all(part.isidentifier() for part in parts):
        return False
    try:
        if importlib.util.find_spec(parts[0]) is None:
            return False
    except (ImportError, ValueError):
        return False
    for cut in range(len(parts) - 1, 0, -1):  # the longest prefix imported already
        owner = sys.modules.get(".".join(parts[:cut]))
        if owner is None:
            continue
        for i, part in enumerate(parts[cut:], start=cut):
            found = vars(owner).get(part) if hasattr(owner, "__dict__") else None
            if found is None:  # a submodule not imported yet is provided if it is installed
                try:
                    return isinstance(owner, types.ModuleType) and \
                        importlib.util.find_spec(".".join(parts[:i + 1])) is not None
                except (ImportError, ValueError):
                    return False
            owner = found
        return True
    return True


def load_payload(path, flag: str = "--resume", mmap: bool = False) -> dict:
    """A checkpoint (or ``.safetensors``) file as a dict, read without running code from it; every problem
    (missing, not a checkpoint, damaged: the pickle's CRC-32 and, unless ``mmap``, every tensor's; code it
    would run) is a one-line ``UsageError`` naming ``flag`` and the file."""
    path = Path(path)
    if not path.is_file():
        what = "no such file" if not os.path.lexists(path) else \
            "a broken or looping symbolic link" if not path.exists() else \
            "a folder, not a file" if path.is_dir() else "not a regular file (a device, pipe or socket)"
        raise UsageError(f"{flag} {shlex.quote(str(path))}: {what}")  # quoted as typed: 'latest ' shows its space
    if _format(path, flag) == "safetensors":
        return _load_safetensors(path, flag)
    try:
        with torch.serialization.safe_globals(list(ALLOWED_GLOBALS)):
            payload = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:
        _refuse_damage(path, flag, pickle_only=False)  # a flipped bit can read as an unknown global or garbage
        raise _unreadable(path, flag, exc) from None
    # torch.load does not check the zip's CRC-32s: the pickle's always, the tensors' unless mapped (not read yet)
    _refuse_damage(path, flag, pickle_only=mmap)
    if not isinstance(payload, dict):
        raise UsageError(f"{flag} {path}: holds a {type(payload).__name__}, not a checkpoint dict or state_dict")
    if isinstance(payload.get(OLD_CHECKSUM), dict) and "algorithm" in payload[OLD_CHECKSUM]:
        del payload[OLD_CHECKSUM]  # {"algorithm": "crc32-v1", "parts": {...}}; the zip's CRC-32s checked the file
    return payload


def _unreadable(path: Path, flag: str, exc: Exception) -> UsageError:
    """Why ``torch.load`` failed on an undamaged file, in one line: code it would run, or what broke."""
    name = _refused_global(exc) if isinstance(exc, pickle.UnpicklingError) else None
    if name is not None and not _provided(name):  # a legacy-format file (no CRC) with a flipped bit, mostly
        return UsageError(f"{flag} {path}: cannot read this file: its pickle names {name!r}, which no installed "
                          f"module provides (a damaged file, or one written by a program not installed here)")
    if name is not None:
        return UsageError(f"{flag} {path}: refused: opening it would import and run {name}; only tensors, "
                          f"numbers, strings and containers of them are read (re-save the file's state_dict "
                          f"with torch.save if you trust it)")
    if isinstance(exc, pickle.UnpicklingError):
        return UsageError(f"{flag} {path}: cannot read this file ({first_line(exc)})")
    # a truncated or foreign file: say which, not a zip/pickle traceback
    return UsageError(f"{flag} {path}: cannot read this file ({first_line(exc, named=True)})")


def _refuse_damage(path: Path, flag: str, pickle_only: bool) -> None:
    """One line if a member of a torch zip file (only its pickle, ``data.pkl``, when ``pickle_only``) does not
    match the CRC-32 or the header the zip recorded for it; nothing for a file that is not a readable zip."""
    try:
        archive = zipfile.ZipFile(path)
    except Exception:
        with open(path, "rb") as f:
            zipped = f.read(4) == ZIP_START
        if zipped and not pickle_only:  # torch.load failed too: miniz's "central directory" or an EINVAL
            raise UsageError(f"{flag} {path}: incomplete: the zip directory at the end of the file is missing or "
                             f"damaged (a save, copy or download that did not finish?); use another checkpoint") \
                from None
        return  # the legacy format (a plain pickle): torch.load's own error says more
    with archive:
        members = archive.infolist()
        for member in members:
            if member.external_attr & 0x10 and not member.is_dir():  # a file with MS-DOS's folder bit, which
                # torch's reader serves as empty
                raise UsageError(f"{flag} {path}: damaged: {member.filename} is marked as a folder in the zip; the "
                                 f"file changed after it was written (a disk or copy fault); use another checkpoint")
        if pickle_only:  # torch's reader matches names regardless of case; none found: every member
            members = [m for m in members if m.filename.rsplit("/", 1)[-1].lower() == "data.pkl"] or members
        for member in members:
            try:
                with archive.open(member) as stream:
                    while stream.read(1 << 22):  # zipfile checks the CRC-32 at the member's end
                        pass
            except Exception as exc:  # BadZipFile, EOFError, NotImplementedError (a flipped compression method)
                why = "does not match the CRC-32 it was written with" if "CRC" in str(exc) else \
                    f"cannot be read ({first_line(exc)})"  # e.g. a local header that shifts where its data starts
                raise UsageError(f"{flag} {path}: damaged: {member.filename} {why}; the file changed after it was "
                                 f"written (a disk or copy fault); use another checkpoint") from None


def _format(path: Path, flag: str) -> str:
    """``torch`` or ``safetensors``, from the file's first bytes (and a ``.safetensors`` name); else one line."""
    try:
        with open(path, "rb") as f:
            head = f.read(32)
        size = path.stat().st_size
    except OSError as exc:
        raise UsageError(f"{flag} {path}: cannot read this file ([Errno {exc.errno}] {exc.strerror})") from None
    if head.startswith((ZIP_START, PICKLE_START)) and path.suffix != ".safetensors":
        return "torch"
    # safetensors: an 8-byte little-endian header length, then the JSON header
    if path.suffix == ".safetensors" or (head[8:9] == b"{" and 0 < int.from_bytes(head[:8], "little") <= size - 8):
        return "safetensors"
    start = f"it starts with {head.decode('utf-8', 'replace')!r}" if head else "it is empty"
    raise UsageError(f"{flag} {path}: not a torch checkpoint or safetensors file ({start})")


def _load_safetensors(path: Path, flag: str) -> dict:
    try:
        return load_file(str(path), device="cpu")
    except Exception as exc:
        raise UsageError(f"{flag} {path}: cannot read this safetensors file ({first_line(exc)})") from None


def load_checkpoint(path, flag: str = "--resume", mmap: bool = False) -> dict:
    """A training checkpoint (ours or open_clip's): the keys a resume needs, or a one-line error."""
    payload = load_payload(path, flag, mmap=mmap)
    missing = [k for k in REQUIRED_KEYS if k not in payload]
    if missing:
        raise UsageError(f"{flag} {path}: not a naflex-accum/open_clip training checkpoint (missing {missing})")
    return payload


def position(payload: dict, where: str = "--resume") -> Tuple[int, int, int]:
    """How far into the run a payload is: (global step, epoch, step in epoch); larger is later. Counters that
    are not whole numbers are one line naming ``where`` (the flag and file)."""
    try:
        return (int(payload.get("global_step", 0)), int(payload["epoch"]), int(payload.get("step_in_epoch", 0)))
    except (TypeError, ValueError, KeyError, OverflowError):
        counters = {k: payload.get(k) for k in ("global_step", "epoch", "step_in_epoch") if k in payload}
        raise UsageError(f"{where}: not a training checkpoint of a run: its counters are not whole numbers "
                         f"({', '.join(f'{k}={v!r:.40}' for k, v in counters.items())})") from None


def checkpoint_files(folder: Path) -> List[Path]:
    if not folder.is_dir():
        return []
    return [p for p in folder.iterdir()
            if p.is_file() and (p.name == MOST_RECENT or EPOCH_RE.match(p.name) or STEP_RE.match(p.name))]


def file_position(path: Path) -> Tuple[int, int, int]:
    """``position`` of a checkpoint file, reading its structure only (its tensors are mapped, not read or checked)."""
    try:  # mmap: only the pickled structure is read, not the tensors
        payload = load_checkpoint(path, mmap=True)
    except UsageError:  # a legacy (non-zip) file cannot be mapped; a damaged one fails again below
        payload = load_checkpoint(path)
    return position(payload, f"--resume {path}")


def newest_loadable(folder: Path) -> Tuple[Optional[Path], Optional[dict]]:
    """The checkpoint of ``folder`` (its top level) furthest into the run that loads completely, and its payload."""
    ranked = []
    for path in checkpoint_files(folder):
        try:
            ranked.append((file_position(path), path))
        except UsageError as exc:
            log.warning(f"--resume latest: skipping {exc}")
    for _, path in sorted(ranked, reverse=True):
        try:
            return path, load_checkpoint(path)  # every tensor read: a damaged file fails here
        except UsageError as exc:
            log.warning(f"--resume latest: skipping {exc}")
    return None, None


def remove_stale_temps(folder: Path) -> List[Path]:
    """Temporary files of writes that never finished (the writer was killed); the run lock makes them stale."""
    stale = [p for p in folder.iterdir() if TEMP_RE.match(p.name)] if folder.is_dir() else []
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


def prune_step_checkpoints(folder: Path, keep_last: int, written: Path, warned: Set[Path]) -> List[Path]:
    """Delete the ``step_G.pt`` files but ``written`` and the ``keep_last - 1`` newest others; the deleted ones.
    One that cannot be deleted stays, with one warning per run (``warned``)."""
    others = sorted((int(m.group(1)), p) for p in folder.iterdir() if (m := STEP_RE.match(p.name)) and p != written)
    doomed = [p for _, p in others[:max(0, len(others) - max(keep_last - 1, 0))]]
    return [p for p in doomed if remove_file(p, f"--keep-last {keep_last}", warned)]


def remove_file(path: Path, why: str, warned: Set[Path]) -> bool:
    """Delete ``path`` (gone already: fine); on failure warn once per path in ``warned`` and return False."""
    try:
        path.unlink(missing_ok=True)
        return True
    except OSError as exc:
        if path not in warned:
            warned.add(path)
            log.warning(f"cannot delete {path} ({why}): [Errno {exc.errno}] {exc.strerror}; it stays, and the run "
                        f"goes on (delete it by hand)")
        return False
