"""The project measured on a GPU in one command: CUDA tests, the step at ViT-B/16 size, both trainers.

Run it through ``benchmarks/gpu_check.sh`` (which installs the kit's wheels where packages are missing):

    bash benchmarks/gpu_check.sh prepare          # here, once: the wheels (.whl/) and the pinned upstream (.gpu-kit/)
    bash benchmarks/gpu_check.sh run --out DIR    # on the GPU machine: DIR/gpu_check.md and DIR/gpu_check.json
    bash benchmarks/gpu_check.sh run --smoke      # CPU, tiny sizes, about a minute: what CI runs

Sections, each a subprocess with its own time limit (the full mode fits 8 minutes; a section that runs
out is reported as such, with what it finished):
  tests     tests/integration/test_cuda.py, tests/integration/test_longrun_cuda.py and the pinned-loader tests (skipped on the CPU);
  accum     benchmarks/gpu_accum.py: upstream's towers, bf16, our steps against upstream's real step;
  trainers  naflex-S-16 on demo shards, bf16, --accum-freq 2, 4 workers: ``naflex-accum train`` and
            upstream's trainer through ``python -m naflex_accum.openclip``, the same flags; samples/s and
            the share of time waiting for data from their console lines, peak memory (``gpu_run.py``).
The report (``gpu_report.py``) lists the targets with PASS/FAIL. Nothing here downloads anything.
"""
import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import upstream_snapshot

ROOT = Path(__file__).resolve().parents[1]
KIT = ROOT / ".gpu-kit"
SNAPSHOT = upstream_snapshot.SNAPSHOT
TESTS = ["tests/integration/test_cuda.py", "tests/integration/test_longrun_cuda.py",
         "tests/integration/test_data_resume.py::test_persistent_pinned_workers_follow_set_epoch",
         "tests/integration/test_data_resume.py::test_pinned_batches_reach_the_gpu_without_a_sync"]
# seconds per section: full mode (8 minutes with the set-up), smoke mode
LIMITS = {"full": dict(tests=130, accum=190, data=20, trainer=50), "smoke": dict(tests=120, accum=150, data=60,
                                                                                  trainer=90)}
TRAIN = {"full": dict(model="naflex-S-16", samples=8192, seq_lens=("64", "144", "256"), tokens=32768,
                      batch=128, workers=4, device="cuda", shard=512, precision="amp_bf16"),
         "smoke": dict(model="naflex-tiny", samples=64, seq_lens=("16", "64"), tokens=512, batch=8,
                       workers=2, device="cpu", shard=16, precision="fp32")}
CONSOLE = re.compile(r"Data \(t\): ([0-9.]+) Batch \(t\): ([0-9.]+), ([0-9.e+]+)/s")


def upstream_src() -> Path:
    """The pinned upstream's src: the kit's copy (``prepare``), else extracted from ``../shared``."""
    found = sorted(KIT.glob("upstream/open_clip-*/src"))
    if found:
        return found[-1]
    return upstream_snapshot.extract(SNAPSHOT, what="gpu_check",
                                     hint=f"run `bash benchmarks/gpu_check.sh prepare` to copy it into {KIT}")


def environment() -> dict:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "cpus": os.cpu_count(), "gpu": None, "driver": None, "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                     time.gmtime())}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        smi = shutil.which("nvidia-smi")
        if smi:
            out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                                 text=True)
            env["driver"] = out.stdout.strip() or None
    for name in ("open_clip", "timm", "webdataset", "simplejpeg"):
        try:
            env[name] = __import__(name).__version__
        except Exception as exc:  # the report says what is missing instead of stopping
            env[name] = f"missing ({type(exc).__name__})"
    return env


def run(cmd, limit, env=None, cwd=ROOT) -> dict:
    """A section's subprocess: return code (None: timed out), seconds, output tail."""
    start = time.perf_counter()
    try:
        proc = subprocess.run([str(c) for c in cmd], cwd=str(cwd), env=env, capture_output=True, text=True,
                              timeout=limit)
        code, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        code = None
        out = "".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
                      for x in (exc.stdout, exc.stderr))
    return {"rc": code, "seconds": round(time.perf_counter() - start, 1), "tail": out[-4000:], "limit": limit}


def with_path(*front, **extra) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, front), *filter(None, [env.get("PYTHONPATH")])])
    return env


def tests_section(work: Path, limit) -> dict:
    junit = work / "tests.xml"
    result = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *TESTS],
                 limit, env=with_path(ROOT))
    result["cases"] = _junit_cases(junit) if junit.is_file() else []
    return result


def _junit_cases(path: Path) -> list:
    import xml.etree.ElementTree as ET

    cases = []
    for case in ET.parse(path).iter("testcase"):
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error"}.get(tag, "skipped")
                cases.append({"name": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                              "message": (node.get("message") or "")[:300]})
                break
        else:
            cases.append({"name": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome})
    return cases


def accum_section(work: Path, src: Path, smoke: bool, limit) -> dict:
    out = work / "accum.json"
    result = run([sys.executable, ROOT / "benchmarks" / "gpu_accum.py", "--upstream-src", src, "--json", out,
                  *(["--smoke"] if smoke else [])], limit, env=with_path(ROOT))
    result["data"] = json.loads(out.read_text()) if out.is_file() else None
    return result


def trainer_args(mode: str, shards: str, logs: Path, name: str) -> list:
    t = TRAIN[mode]
    return ["--train-data", shards, "--train-num-samples", t["samples"], "--naflex-seq-lens", *t["seq_lens"],
            "--naflex-max-tokens-per-batch", t["tokens"], "--batch-size", t["batch"], "--accum-freq", "2",
            "--naflex-loss-scale", "linear", "--workers", t["workers"], "--precision", t["precision"], "--epochs", "1",
            "--lr", "1e-4", "--warmup", "2", "--log-every-n-steps", "2", "--device", t["device"], "--logs", logs,
            "--name", name]


def trainers_section(work: Path, src: Path, mode: str, limits) -> dict:
    data = work / "demo"
    t = TRAIN[mode]
    made = run([sys.executable, "-m", "naflex_accum.cli", "make-demo-data", data, "--num-samples", t["samples"],
                "--val-samples", "0", "--shard-size", t["shard"], "--processes", min(8, os.cpu_count() or 1)], limits["data"], env=with_path(ROOT))
    if made["rc"] != 0:
        return {"data": made}
    last = len(list((data / "train").glob("*.tar"))) - 1
    shards = str(data / "train" / f"shard-{{000000..{last:06d}}}.tar")
    out = {"data": made}
    cfg = json.loads((ROOT / "naflex_accum" / "model_configs" / f"{t['model']}.json").read_text())
    upstream_model = work / "upstream-model"
    upstream_model.mkdir(exist_ok=True)
    (upstream_model / "open_clip_config.json").write_text(json.dumps({"model_cfg": cfg}))
    runs = {"ours": (["naflex_accum.cli", "train", "--model", t["model"]], with_path(ROOT)),
            "upstream": (["--timm-sizes", "naflex_accum.openclip", "--use-naflex", "--dataset-type", "webdataset",
                          "--model", f"local-dir:{upstream_model}"], with_path(src, ROOT))}
    for name, (head, env) in runs.items():
        memory = work / f"{name}-memory.json"
        result = run([sys.executable, ROOT / "benchmarks" / "gpu_run.py", memory, *head,
                      *trainer_args(mode, shards, work / "logs", name)], limits["trainer"], env=env, cwd=work)
        log = work / "logs" / name / "out.log"
        result.update(console_figures(log.read_text() if log.is_file() else ""))
        result.update(json.loads(memory.read_text()) if memory.is_file() else {})
        out[name] = result
    return out


def console_figures(log: str) -> dict:
    """samples/s (median over the logged steps after the first) and the share of step time spent on data."""
    import statistics

    rows = [tuple(map(float, m.groups())) for m in CONSOLE.finditer(log)]
    steady = rows[1:] or rows
    if not steady:
        return {"logged_steps": 0}
    return {"logged_steps": len(rows), "samples_per_s": statistics.median(r[2] for r in steady),
            "data_share": sum(r[0] for r in steady) / max(sum(r[1] for r in steady), 1e-9)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny sizes (what CI runs)")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for gpu_check.md and gpu_check.json (default logs/gpu_check/DATE-TIME)")
    parser.add_argument("--sections", nargs="+", choices=("tests", "accum", "trainers"),
                        default=["tests", "accum", "trainers"])
    args = parser.parse_args(argv)
    mode = "smoke" if args.smoke else "full"
    out = args.out or ROOT / "logs" / "gpu_check" / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    for name in ("gpu_check.md", "gpu_check.json"):
        if (out / name).exists():
            raise SystemExit(f"gpu_check: {out / name} exists; pass another --out (nothing was overwritten)")
    limits, src, started = LIMITS[mode], upstream_src(), time.perf_counter()
    report = {"mode": mode, "environment": environment(), "upstream_src": str(src), "sections": {}}
    with tempfile.TemporaryDirectory(prefix="naflex-gpu-check-") as tmp:
        work = Path(tmp)
        for section in args.sections:
            print(f"gpu_check: {section} ...", flush=True)
            if section == "tests":
                report["sections"]["tests"] = tests_section(work, limits["tests"])
            elif section == "accum":
                report["sections"]["accum"] = accum_section(work, src, args.smoke, limits["accum"])
            else:
                report["sections"]["trainers"] = trainers_section(work, src, mode, limits)
    report["seconds"] = round(time.perf_counter() - started, 1)
    from gpu_report import write_report

    broken, missed = write_report(report, out)
    print(f"gpu_check: {report['seconds']:.0f} s; report {out / 'gpu_check.md'}; {broken} section(s) broken, "
          f"{missed} target(s) missed")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
