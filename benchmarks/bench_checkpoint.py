"""Checkpoint save and load time against a baseline commit's reader and writer, in one run.

A payload shaped like a training checkpoint (weights, two AdamW moments per weight, counters; about
``--mib`` MiB on disk) is saved and loaded ``--repeats`` times by each side, interleaved, the file's pages
in the page cache (warm: each file is read once before it is timed):
  save  ``save_checkpoint`` (the temporary file, fsync, rename)
  load  ``load_payload`` of the file that side wrote (every check a full read makes)
plus ``torch.load`` alone, the floor both loads sit on. The baseline's ``train/checkpoint.py`` (and
``train/integrity.py`` where it has one) come from ``git show REF:...``, imported beside today's.

    python benchmarks/bench_checkpoint.py [--baseline REF] [--mib 200] [--repeats 3] [--dir DIR]
"""
import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from naflex_accum.train import checkpoint

ROOT = Path(__file__).resolve().parents[1]


def baseline(ref: str, folder: Path):
    """``train/checkpoint.py`` as of ``ref``, imported as a sibling of today's (its relative imports resolve)."""
    module = None
    for name in ("integrity", "checkpoint"):
        shown = subprocess.run(["git", "show", f"{ref}:naflex_accum/train/{name}.py"], cwd=ROOT,
                               capture_output=True, text=True)
        if shown.returncode:
            continue  # a baseline without integrity.py
        path = folder / f"{name}.py"
        path.write_text(shown.stdout)
        qualified = f"naflex_accum.train.{name}" if name == "integrity" else "naflex_accum.train.baseline_checkpoint"
        spec = importlib.util.spec_from_file_location(qualified, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[qualified] = module
        spec.loader.exec_module(module)
    if module is None:
        sys.exit(f"--baseline {ref}: no naflex_accum/train/checkpoint.py there")
    return module


def payload(mib: int) -> dict:
    """Weights (square matrices and vectors), AdamW's two moments per weight, counters and a random state."""
    g = torch.Generator().manual_seed(0)
    side = 1024
    matrices = max(1, round(mib * 2 ** 20 / 3 / (side * side * 4)))
    weights = {f"blocks.{i}.w": torch.randn(side, side, generator=g) for i in range(matrices)}
    weights.update({f"blocks.{i}.b": torch.randn(side, generator=g) for i in range(matrices)})
    state = {i: {"step": torch.tensor(10.0), "exp_avg": torch.randn_like(w), "exp_avg_sq": torch.rand_like(w)}
             for i, w in enumerate(weights.values())}
    return {"epoch": 3, "global_step": 1200, "state_dict": weights,
            "optimizer": {"state": state, "param_groups": [{"lr": 1e-3, "params": list(state)}]},
            "rng_states": [torch.get_rng_state()]}


def timed(fn, *args) -> float:
    started = time.perf_counter()
    fn(*args)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default=None, help="the commit to compare with (default: the last one with "
                                                         "train/integrity.py)")
    parser.add_argument("--mib", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the files go (default: a temporary folder)")
    args = parser.parse_args()
    ref = args.baseline
    if ref is None:  # the commit that removed integrity.py, less one
        removed = subprocess.run(["git", "rev-list", "-n", "1", "HEAD", "--", "naflex_accum/train/integrity.py"],
                                 cwd=ROOT, capture_output=True, text=True).stdout.strip()
        ref = f"{removed}^"
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        folder = Path(tmp)
        old = baseline(ref, folder)
        data = payload(args.mib)
        files = {"baseline": folder / "old.pt", "today": folder / "new.pt"}
        sides = {"baseline": old, "today": checkpoint}
        times = {f"{what} {side}": [] for what in ("save", "load") for side in sides} | {"torch.load alone": []}
        for _ in range(args.repeats + 1):  # the first round warms the page cache and the imports
            for side, module in sides.items():
                times[f"save {side}"].append(timed(module.save_checkpoint, files[side], data))
            for side, module in sides.items():
                times[f"load {side}"].append(timed(module.load_payload, files[side]))
            times["torch.load alone"].append(timed(lambda: torch.load(files["today"], "cpu", weights_only=True)))
        size = files["today"].stat().st_size / 2 ** 20
        medians = {name: statistics.median(values[1:]) for name, values in times.items()}
        short = subprocess.run(["git", "rev-parse", "--short", ref], cwd=ROOT, capture_output=True, text=True)
        print(f"baseline {short.stdout.strip()}, a {size:.0f} MiB checkpoint, median of {args.repeats}, warm cache, "
              f"torch {torch.__version__}")
        for name, value in medians.items():
            side = name.rsplit(" ", 1)[-1]
            ratio = f"  {value / medians[name.replace(side, 'baseline')]:.2f}x baseline" if side == "today" else ""
            print(f"  {name:<18} {value:7.3f} s{ratio}")


if __name__ == "__main__":
    main()
