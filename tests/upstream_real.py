"""The pinned upstream open_clip main snapshots, extracted once per test run, and helpers to run them.

``../shared/upstream/open_clip-COMMIT.tar.gz`` (from the checkout root) is
upstream's source at a fixed commit: 89fb801 (the ``report`` contract, the
default fixture ``upstream_src``) and 5964c41 (the older ``losses`` one);
``pinned`` runs a test on each. Upstream runs only in subprocesses, from this
venv (``sys.executable``) with its ``src`` first on PYTHONPATH, so the open_clip
3.3.0 that the rest of the suite imports is never shadowed. Without a tarball
(a checkout without ``../shared``) the tests that need it skip with the reason;
under CI (``$CI`` or ``$NAFLEX_ACCUM_REQUIRE_UPSTREAM`` set) they fail instead,
so a missing fixture cannot pass as green.
"""
import compileall
import json
import os
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "upstream"
JOBS = Path(__file__).resolve().parent / "upstream_jobs"


@dataclass(frozen=True)
class Pinned:
    commit: str
    version: str  # open_clip.version.__version__ at that commit
    contract: str  # naflex_accum.accum.contract generation name
    tokens_flag: str  # its NaFlex token-budget flag (renamed between the two)
    src: Path = None

    @property
    def tarball(self) -> Path:
        return SHARED / f"open_clip-{self.commit}.tar.gz"


PINNED = {
    "89fb801": Pinned("89fb801", "4.2.0.dev0", "report", "--naflex-max-tokens-per-batch"),
    "5964c41": Pinned("5964c41", "4.0.0.dev0", "losses", "--naflex-max-image-tokens-per-batch"),
}
TARBALL = PINNED["89fb801"].tarball
# Upstream's sample shuffle is seeded from time and pid; a buffer of one keeps shard order.
DETERMINISTIC = {"OPENCLIP_WDS_SAMPLE_SHUFFLE_SIZE": "1", "OPENCLIP_WDS_SAMPLE_SHUFFLE_INITIAL": "1"}
TIMEOUT = 600

def _required() -> bool:
    return any(os.environ.get(var, "").strip() not in ("", "0", "false") for var in
               ("CI", "NAFLEX_ACCUM_REQUIRE_UPSTREAM"))


_EXTRACTED = {}


def extract(tmp_path_factory, name: str) -> Path:
    """The folder ``open_clip-<name>`` from ``shared/upstream/open_clip-<name>.tar.gz``, extracted once per run."""
    if name not in _EXTRACTED:
        tarball = SHARED / f"open_clip-{name}.tar.gz"
        if not tarball.is_file():
            reason = f"pinned upstream open_clip not found at {tarball} (it lives in ../shared next to the checkout)"
            if _required():
                pytest.fail(f"{reason}; under CI the upstream tests must run")
            pytest.skip(reason)
        dest = tmp_path_factory.mktemp(f"upstream-{name}")
        with tarfile.open(tarball) as tar:
            tar.extractall(dest, filter="data")
        # bytecode made once here: the many processes that import it may not write it (PYTHONDONTWRITEBYTECODE)
        compileall.compile_dir(dest, quiet=2)
        _EXTRACTED[name] = dest
    return _EXTRACTED[name] / f"open_clip-{name.split('-')[0]}"


def _src(tmp_path_factory, commit: str) -> Path:
    src = extract(tmp_path_factory, commit) / "src"
    assert (src / "open_clip_train" / "train.py").is_file(), f"unexpected layout in {PINNED[commit].tarball}"
    return src


@pytest.fixture(scope="session")
def upstream_src(tmp_path_factory) -> Path:
    """``src`` of the pinned upstream 89fb801, extracted into a temporary folder once per test run."""
    return _src(tmp_path_factory, "89fb801")


@pytest.fixture(scope="session", params=list(PINNED), ids=lambda commit: f"upstream-{commit}")
def pinned(request, tmp_path_factory) -> Pinned:
    """Each pinned upstream commit in turn, with its ``src`` extracted."""
    info = PINNED[request.param]
    return Pinned(info.commit, info.version, info.contract, info.tokens_flag, _src(tmp_path_factory, info.commit))


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
    # upstream's src first (its open_clip over the released one), then this checkout's package
    env["PYTHONPATH"] = os.pathsep.join([str(src), str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
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
