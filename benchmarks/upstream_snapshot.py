"""The pinned upstream open_clip main (``../shared/upstream``) unpacked for a benchmark: its ``src`` folder.

Invariant: a benchmark that needs upstream either gets the ``src`` of the archive it named or stops with one
line naming that archive and what to pass instead; one for which upstream is an optional row gets None and
says the rows are skipped. What it unpacks lives in a temporary folder removed when the process exits.
"""
import atexit
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
SNAPSHOT = ROOT.parent / "shared" / "upstream" / "open_clip-89fb801.tar.gz"


def extract(archive: Path = SNAPSHOT, required: bool = True, what: str = "benchmark",
            hint: str = "pass --upstream PATH to an open_clip-<commit>.tar.gz") -> Optional[Path]:
    """``archive``'s ``open_clip-*/src``; without the archive: exit 2 with one line if ``required``, else None."""
    archive = Path(archive)
    if not archive.is_file():
        if required:
            print(f"{what}: upstream snapshot {archive} not found; {hint}", file=sys.stderr)
            raise SystemExit(2)
        print(f"({what}: no {archive}: upstream rows skipped)")
        return None
    folder = Path(tempfile.mkdtemp(prefix="naflex-upstream-"))
    atexit.register(shutil.rmtree, folder, True)
    with tarfile.open(archive) as tar:
        tar.extractall(folder, filter="data")
    found = sorted(folder.glob("*/src"))
    if not found:
        print(f"{what}: {archive} holds no open_clip-*/src folder: is it upstream open_clip's source archive?",
              file=sys.stderr)
        raise SystemExit(2)
    return found[0]
