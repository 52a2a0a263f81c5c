"""``--torchcompile`` against eager on the CPU: compile time, then the steady-state window time, one run.

Builds the model and task as the built-in trainer does (``train.main.build_task``, from its own flag
parser), once eager and once with ``--torchcompile``, and feeds both the same random NaFlex windows
(k = 2, the default cached-loss step, every sequence length of ``--naflex-seq-lens`` in turn, the batch
size from the token budget). Compile time: the compiled model's first pass over every sequence length,
less what eager takes for the same windows. Steady state: the median window time over ``--windows``
rounds, eager and compiled interleaved. Prints the ratio compiled / eager.

    python benchmarks/bench_compile.py [--model naflex-tiny] [--windows 12] [--threads 2]
"""
import argparse
import statistics
import time
from contextlib import nullcontext


def build(model: str, compiled: bool, seq_lens):
    from naflex_accum.train.ending.distributed import World
    from naflex_accum.train.main import build_optimizer, build_task
    from naflex_accum.train.config.params import parse_args

    flags = ["--train-data", "unused.tar", "--model", model, "--device", "cpu", "--accum-freq", "2",
             "--naflex-seq-lens", *map(str, seq_lens)] + (["--torchcompile"] if compiled else [])
    args = parse_args(flags)
    task, net = build_task(args, World(), None)
    return args, task, build_optimizer(net, args), net


def windows(seq_lens, budget: int, count: int, net):
    from naflex_accum.upstream.audit import WindowSpec, random_window

    spec = WindowSpec(context_length=net.context_length, vocab_size=net.vocab_size)
    out = []
    for i in range(count):
        seq = seq_lens[i % len(seq_lens)]
        size = budget // seq
        out.append(random_window([size, size], seed=i, seq_lens=[seq], spec=spec))
    return out


def run_window(step, task, optimizer, window, args) -> float:
    start = time.perf_counter()
    accum_state = ([], {})
    for batch in window:
        step(task, batch, accum_state, optimizer, None, nullcontext, args)
    return time.perf_counter() - start


def main():
    import torch

    from naflex_accum.accum.modes import get_step

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="naflex-tiny")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[64, 144, 256])
    parser.add_argument("--budget", type=int, default=2048, help="tokens per microbatch")
    parser.add_argument("--windows", type=int, default=12, help="steady-state rounds")
    parser.add_argument("--threads", type=int, default=2)
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    step = get_step("cached-loss")
    torch.manual_seed(0)
    eager = build(opts.model, False, opts.seq_lens)
    torch.manual_seed(0)
    compiled = build(opts.model, True, opts.seq_lens)
    first = windows(opts.seq_lens, opts.budget, len(opts.seq_lens), eager[3])
    eager_first = sum(run_window(step, eager[1], eager[2], w, eager[0]) for w in first)
    compiled_first = sum(run_window(step, compiled[1], compiled[2], w, compiled[0]) for w in first)
    steady = {"eager": [], "compiled": []}
    for window in windows(opts.seq_lens, opts.budget, opts.windows, eager[3]):
        steady["eager"].append(run_window(step, eager[1], eager[2], window, eager[0]))
        steady["compiled"].append(run_window(step, compiled[1], compiled[2], window, compiled[0]))
    e, c = statistics.median(steady["eager"]), statistics.median(steady["compiled"])
    print(f"--model {opts.model}, seq lens {opts.seq_lens}, {opts.budget} tokens a microbatch, k = 2, "
          f"{opts.threads} CPU threads, torch {torch.__version__}")
    print(f"compile: {compiled_first - eager_first:.1f} s (first pass over the {len(opts.seq_lens)} sequence "
          f"lengths: compiled {compiled_first:.1f} s, eager {eager_first:.2f} s)")
    print(f"steady state, median window over {opts.windows}: eager {e * 1e3:.1f} ms, compiled {c * 1e3:.1f} ms, "
          f"compiled / eager {c / e:.3f} (speed-up {e / c:.2f}x)")


if __name__ == "__main__":
    main()
