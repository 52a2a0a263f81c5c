"""What the runner's checks cost before a run starts: the contract probe at install, and the self-check.

For each pinned upstream snapshot (``../shared/upstream/open_clip-COMMIT.tar.gz``)
and each task kind (CLIP, SigLIP, CoCa), in a fresh process with that upstream's
``src`` first on ``sys.path``: the seconds ``probe.probe`` takes (what
``install()`` runs), and the seconds ``selfcheck.run`` takes on arguments
parsed by upstream's own ``parse_args`` (what every rank of
``naflex_accum.openclip`` runs before upstream's ``main`` goes on: 8 audit rows of
the patched step and 3 of upstream's own), the median of ``--repeats``, after
one warm-up; then the whole runner start, from ``python -m
naflex_accum.openclip`` to upstream's ``main`` refusing a missing data folder,
with and without ``NAFLEX_ACCUM_VERIFY=0`` (the median of ``--repeats`` fresh
processes, interleaved). CPU only; nothing is asserted.

    python benchmarks/bench_selfcheck.py [--repeats 5]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared" / "upstream"
COMMITS = ("89fb801", "5964c41")
KINDS = {"clip": [], "siglip": ["--siglip"], "coca": ["--model", "coca_ViT-B-32"]}

CHILD = r"""
import json, statistics, sys, time
import torch
import naflex_accum
from naflex_accum.upstream import selfcheck
from naflex_accum.upstream.probe import probe
import open_clip_train.train as train
from open_clip_train.params import parse_args

repeats, kinds = int(sys.argv[1]), json.loads(sys.argv[2])
naflex_accum.install()
original = naflex_accum.upstream.patch.original_step()
out = {}
for kind, extra in kinds.items():
    args = parse_args(["--accum-freq", "2", "--naflex-loss-scale", "linear", "--batch-size", "16", *extra])
    args.rank, args.world_size, args.distributed = 0, 1, False
    probes, checks = [], []
    for i in range(repeats + 1):
        t = time.perf_counter(); found = probe(train, original, kind); probes.append(time.perf_counter() - t)
        t = time.perf_counter(); outcome = selfcheck.run(args, original); checks.append(time.perf_counter() - t)
        assert found.problem is None and outcome.passed, (found.problem, outcome)
    out[kind] = {"probe": statistics.median(probes[1:]), "check": statistics.median(checks[1:]),
                 "rows": outcome.rows, "task": outcome.task}
print(json.dumps(out))
"""


def _env(src: Path, **extra) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src), *filter(None, [os.environ.get("PYTHONPATH")])]))
    env.update(extra)
    return env


def _runner_start(src: Path, work: Path, verify: str) -> float:
    """Seconds from the runner's start to upstream's main refusing a missing --train-data folder."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "naflex_accum.openclip", "--accum-freq", "2", "--train-data",
                    str(work / "missing-{0..1}.tar"), "--dataset-type", "webdataset", "--train-num-samples", "8",
                    "--device", "cpu", "--logs", str(work / f"logs-{time.time_ns()}")], cwd=work,
                   env=_env(src, NAFLEX_ACCUM_VERIFY=verify), capture_output=True, text=True, timeout=600)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"bench_selfcheck: CPU, {os.cpu_count()} cores, median of {args.repeats} after a warm-up")
    with tempfile.TemporaryDirectory() as tmp:
        for commit in COMMITS:
            tarball = SHARED / f"open_clip-{commit}.tar.gz"
            if not tarball.is_file():
                print(f"  {commit}: {tarball} not found, skipped")
                continue
            with tarfile.open(tarball) as tar:
                tar.extractall(tmp, filter="data")
            src = Path(tmp) / f"open_clip-{commit}" / "src"
            proc = subprocess.run([sys.executable, "-c", CHILD, str(args.repeats), json.dumps(KINDS)],
                                  env=_env(src), capture_output=True, text=True, timeout=1200)
            if proc.returncode != 0:
                print(proc.stderr[-3000:], file=sys.stderr)
                return 1
            for kind, r in json.loads(proc.stdout.strip().splitlines()[-1]).items():
                print(f"  upstream {commit} {kind:<7} probe {r['probe']:.3f} s   self-check {r['check']:.3f} s "
                      f"({r['rows']} rows + 3 of upstream's own step, {r['task']})")
            starts = {"1": [], "0": []}
            for _ in range(args.repeats):
                for verify in starts:
                    starts[verify].append(_runner_start(src, Path(tmp), verify))
            on, off = (statistics.median(starts[v]) for v in ("1", "0"))
            print(f"  upstream {commit} runner start to upstream's first refusal: {on:.2f} s with the checks, "
                  f"{off:.2f} s with NAFLEX_ACCUM_VERIFY=0 (+{on - off:.2f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
