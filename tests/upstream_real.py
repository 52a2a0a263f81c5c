"""The pinned upstream open_clip main, extracted once per test run, and helpers to run it in subprocesses.

``../shared/upstream/open_clip-89fb801.tar.gz`` (from the checkout root) is
upstream's source at a fixed commit. Upstream runs only in subprocesses, from
this venv (``sys.executable``) with its ``src`` first on PYTHONPATH, so the
open_clip 3.3.0 that the rest of the suite imports is never shadowed. Without
the tarball (a checkout without ``../shared``) the tests that need it skip with
the reason; under CI (``$CI`` or ``$NAFLEX_ACCUM_REQUIRE_UPSTREAM`` set) they
fail instead, so a missing fixture cannot pass as green.
"""
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TARBALL = ROOT.parent / "shared" / "upstream" / "open_clip-89fb801.tar.gz"
TOP = "open_clip-89fb801"
JOBS = Path(__file__).resolve().parent / "upstream_jobs"
# Upstream's sample shuffle is seeded from time and pid; a buffer of one keeps shard order.
DETERMINISTIC = {"OPENCLIP_WDS_SAMPLE_SHUFFLE_SIZE": "1", "OPENCLIP_WDS_SAMPLE_SHUFFLE_INITIAL": "1"}
TIMEOUT = 600

def _required() -> bool:
    return any(os.environ.get(var, "").strip() not in ("", "0", "false") for var in
               ("CI", "NAFLEX_ACCUM_REQUIRE_UPSTREAM"))


@pytest.fixture(scope="session")
def upstream_src(tmp_path_factory) -> Path:
    """``src`` of the pinned upstream, extracted into a temporary folder once per test run."""
    if not TARBALL.is_file():
        reason = f"pinned upstream open_clip not found at {TARBALL} (it lives in ../shared next to the checkout)"
        if _required():
            pytest.fail(f"{reason}; under CI the upstream tests must run")
        pytest.skip(reason)
    dest = tmp_path_factory.mktemp("upstream")
    with tarfile.open(TARBALL) as tar:
        tar.extractall(dest, filter="data")
    src = dest / TOP / "src"
    assert (src / "open_clip_train" / "train.py").is_file(), f"unexpected layout in {TARBALL}"
    return src


@pytest.fixture(scope="session")
def demo_shards(tmp_path_factory) -> str:
    """48 demo samples in one shard, written by ``naflex-accum make-demo-data``; the --train-data pattern."""
    from naflex_accum import cli

    folder = tmp_path_factory.mktemp("upstream-data") / "demo"
    code = cli.main(["make-demo-data", str(folder), "--num-samples", "48", "--val-samples", "0",
                     "--shard-size", "48", "--processes", "1"])
    assert code == 0
    return str(folder / "train" / "shard-{000000..000000}.tar")


def upstream_env(src: Path, **extra: str) -> dict:
    """This environment with upstream's ``src`` first on PYTHONPATH; ``extra`` on top, ``None`` removes."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(src), *filter(None, [env.get("PYTHONPATH")])])
    for key, value in extra.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def run_python(src: Path, args, cwd, env=None, timeout: int = TIMEOUT) -> subprocess.CompletedProcess:
    """``python ARGS`` from this venv against upstream; the output is kept for failure messages."""
    return subprocess.run([sys.executable, *map(str, args)], cwd=str(cwd), env=env or upstream_env(src),
                          capture_output=True, text=True, timeout=timeout)


def last_json(proc: subprocess.CompletedProcess):
    """The JSON object a job printed on its last stdout line; fails with the job's output otherwise."""
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines, f"exit {proc.returncode}\n{tail(proc)}"
    return json.loads(lines[-1])


def tail(proc: subprocess.CompletedProcess, n: int = 40) -> str:
    return "\n".join((proc.stdout + "\n" + proc.stderr).strip().splitlines()[-n:])
