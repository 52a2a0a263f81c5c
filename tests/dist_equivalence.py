"""Run under torchrun (2 processes, gloo, CPU): accumulated gradients vs one unaccumulated backward.

Each rank holds its own examples; the same examples on each rank go once
through one full-batch backward (DDP-averaged gradients) and once through an
accumulation window split unevenly, linear loss scale. Every parameter's
gradient right before the optimizer step must equal the window scale times
the full-batch one on every rank, logit gradients counted once. Prints one
JSON line per case from rank 0; exits 1 if any case fails on any rank.
"""
import argparse
import importlib
import json
import os
import sys
import warnings
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from naflex_accum.audit import accumulated_grads, compare, full_batch_grads, random_window
from naflex_accum.cached_loss import cached_loss_step
from naflex_accum.models import create_model
from naflex_accum.scales import window_loss_scale
from naflex_accum.step import train_step_eager
from naflex_accum.tasks import create_task

CASES = [  # (loss, loss options, split)
    ("clip", {}, (1, 2)),
    ("clip", {}, (5, 2, 1)),
    ("clip", {"local_loss": True, "gather_with_grad": True}, (3, 1, 2)),
    ("siglip", {}, (2, 1)),
    ("siglip", {}, (1, 4, 2)),
]
STEPS = {"replay": train_step_eager, "cached-loss": cached_loss_step}


def make_task(loss, options, rank, world):
    torch.manual_seed(0)  # identical weights on every rank, as DDP requires
    model = create_model("naflex-tiny", siglip=loss == "siglip", patch_dropout=0.3)
    task = create_task(model, siglip=loss == "siglip", rank=rank, world_size=world, **options)
    task.trainable_module = DDP(model)
    return task


def run_case(rank, world, loss, options, split, mode, step):
    task = make_task(loss, options, rank, world)
    task.train()
    batches = random_window(split, seed=100 + rank)  # each rank its own examples
    seeds = [1000 * (rank + 1) + j for j in range(len(split))]
    reference, _ = full_batch_grads(task, batches, seeds, chunked=True)
    args = SimpleNamespace(accum_freq=len(split), batch_size=4, naflex_loss_scale="linear", grad_clip_norm=None)
    grads, _, n = accumulated_grads(step, task, batches, seeds, args)
    scale = window_loss_scale(list(split), 4, "linear")
    err, worst, ratios = compare(grads, reference, scale)
    ok = err <= 1e-5 and all(abs(r - 1) <= 1e-5 for r in ratios.values()) and n == sum(split)
    return {"rank": rank, "mode": mode, "loss": loss, **options, "split": list(split), "window_scale": scale,
            "tower_rel_err": err, "worst_param": worst, "logit_ratios": ratios, "passed": ok}


def parse_steps():
    parser = argparse.ArgumentParser()
    parser.add_argument("--step", default=None, help="MODULE:FUNCTION to audit instead of ours (both modes)")
    spec = parser.parse_args().step
    if spec is None:
        return STEPS
    module, _, name = spec.partition(":")
    return {spec: getattr(importlib.import_module(module), name)}


def main() -> int:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="Grad strides do not match")  # DDP perf note on a [1,1,C] token
    warnings.filterwarnings("ignore", category=FutureWarning)
    steps = parse_steps()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    failed = 0
    for mode in steps:
        for loss, options, split in CASES:
            result = run_case(rank, world, loss, options, split, mode, steps[mode])
            gathered = [None] * world
            dist.all_gather_object(gathered, result)
            if rank == 0:
                for r in gathered:
                    print(json.dumps(r), flush=True)
            failed += sum(not r["passed"] for r in gathered)
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for --step bug_reference:...
    sys.exit(main())
