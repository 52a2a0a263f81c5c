"""Per-rank memory of ``--fsdp`` against DDP: parameter, gradient and optimizer-state bytes, one run.

Starts torchrun (gloo, CPU) with ``--nproc`` processes twice, DDP then FSDP2 as the
built-in trainer wraps them (``train.main.build_task``, ``build_optimizer``), runs one
accumulation window (k = 2, the cached-loss step) on random NaFlex batches, and counts
the bytes each rank holds after the optimizer step: its parameters (its shards under
FSDP), their gradients, and AdamW's state. Prints a table and the FSDP/DDP ratios;
with N ranks FSDP holds about 1/N of each.

    python benchmarks/bench_fsdp.py [--model naflex-B-16] [--nproc 2]
"""
import argparse
from contextlib import nullcontext
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def child(model_name: str, wrap: str, out: str) -> None:
    import torch

    from naflex_accum.upstream.audit import WindowSpec, random_window
    from naflex_accum.accum.modes import get_step
    from naflex_accum.train.ending.distributed import init_distributed
    from naflex_accum.train.main import build_optimizer, build_task
    from naflex_accum.train.config.params import parse_args

    torch.set_num_threads(1)
    world, device = init_distributed("cpu")
    flags = ["--train-data", "unused.tar", "--model", model_name, "--device", "cpu", "--accum-freq", "2",
             "--naflex-loss-scale", "linear", "--batch-size", "4"] + (["--fsdp"] if wrap == "fsdp" else [])
    args = parse_args(flags)
    task, model = build_task(args, world, device)
    optimizer = build_optimizer(model, args)
    step = get_step("cached-loss")
    accum_state = ([], {})
    spec = WindowSpec(context_length=model.context_length, vocab_size=model.vocab_size)
    for batch in random_window([2, 2], seed=world.rank, seq_lens=[64], spec=spec):
        step(task, batch, accum_state, optimizer, None, nullcontext, args)
    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    row = {"rank": world.rank, "params": _bytes(params), "grads": _bytes(p.grad for p in params),
           "optimizer": _bytes(state)}
    Path(f"{out}-{world.rank}.json").write_text(json.dumps(row))
    world.close()  # the side channel's goodbye, then the process group


def run(model_name: str, nproc: int, wrap: str, folder: str):
    out = os.path.join(folder, wrap)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           __file__, "--child", wrap, "--model", model_name, "--out", out]
    path = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
    if proc.returncode:
        sys.exit(f"bench_fsdp: the {wrap} run failed:\n{proc.stderr[-3000:]}")
    return [json.loads(Path(f"{out}-{r}.json").read_text()) for r in range(nproc)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="naflex-B-16")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.model, args.child, args.out)
    with tempfile.TemporaryDirectory() as folder:
        rows = {wrap: run(args.model, args.nproc, wrap, folder) for wrap in ("ddp", "fsdp")}
    print(f"--model {args.model}, {args.nproc} ranks (torchrun, gloo, CPU), after one window (k = 2) and "
          f"its AdamW step; MiB held by each rank\n")
    print("| rank | kind | DDP | FSDP | FSDP / DDP |\n|---|---|---|---|---|")
    for r in range(args.nproc):
        for kind in ("params", "grads", "optimizer"):
            a, b = rows["ddp"][r][kind], rows["fsdp"][r][kind]
            print(f"| {r} | {kind} | {a / 2**20:.1f} | {b / 2**20:.1f} | {b / a:.3f} |")
    total = {w: sum(rows[w][0][k] for k in ("params", "grads", "optimizer")) for w in rows}
    print(f"\nrank 0 in all: DDP {total['ddp'] / 2**20:.1f} MiB, FSDP {total['fsdp'] / 2**20:.1f} MiB "
          f"({total['fsdp'] / total['ddp']:.3f}x; 1/{args.nproc} would be {1 / args.nproc:.3f}x)")


if __name__ == "__main__":
    main()
