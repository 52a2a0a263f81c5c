"""Run under torchrun (2 processes, gloo, CPU): accumulated gradients vs one unaccumulated backward.

Each rank holds its own examples; the same examples on each rank go once
through one full-batch backward (gradients reduced across ranks) and once
through an accumulation window split unevenly, linear loss scale. Every
parameter's gradient right before the optimizer step must equal the window
scale times the full-batch one on every rank, logit gradients counted once,
and the window must reduce gradients across ranks exactly as often as the one
full-batch backward does: one round per window.

- ``--wrap ddp`` (default): DistributedDataParallel; a communication hook
  counts all-reduce rounds (a round ends at the bucket whose ``is_last()``).
  ``--find-unused-parameters`` lets DDP tolerate a synced backward that leaves
  parameters out (the logit ones), so a missing ``no_sync`` shows in the count
  instead of as DDP's error.
- ``--wrap fsdp2``: real ``fully_shard`` (FSDP2) per transformer block and at
  the root; reduce-scatter calls are counted.
- ``--wrap fsdp2-bf16``: the same under upstream's ``--fsdp --precision amp_bf16``
  policy, ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``: bf16
  tolerance (``unit.accum.test_precision``'s), the reference under the same policy.

Prints one JSON line per case from rank 0; exits 1 if any case fails on any rank.
``--bug NAME`` runs a reference bug (``naflex_accum.testing.bugs``) in both modes instead of ours;
``--quick`` only the first two cases of each wrapping. ``--then`` starts another set of these options in the
same processes (several checks for one torchrun start); each line's ``job`` says which set it belongs to.
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

from naflex_accum import cached_loss_step, replay_step
from naflex_accum.accum.scales import window_loss_scale
from naflex_accum.models import create_coca_model, create_model, load_config
from naflex_accum.tasks import create_task
from naflex_accum.testing.bugs import bug_step
from naflex_accum.upstream.audit import accumulated_grads, compare, full_batch_grads, random_window, window_spec

CASES = {  # wrap -> [(loss, loss options, split)]
    "ddp": [("clip", {}, (1, 2)),
            ("clip", {}, (5, 2, 1)),
            ("clip", {"local_loss": True, "gather_with_grad": True}, (3, 1, 2)),
            ("siglip", {}, (2, 1)),
            ("siglip", {}, (1, 4, 2)),
            ("coca", {}, (2, 1, 3))],
    "fsdp2": [("siglip", {}, (1, 3, 2)),
              ("clip", {}, (2, 1))],
    "fsdp2-bf16": [("siglip", {}, (1, 3, 2)),
                   ("clip", {}, (2, 1))],
}
TOLERANCE = {"fsdp2-bf16": (5e-2, 2e-2)}  # wrap -> (tower, logit ratio); else 1e-5 both
STEPS = {"replay": replay_step, "cached-loss": cached_loss_step}


class Counter:
    """Gradient-reduction rounds: DDP through a communication hook, FSDP2 by wrapping its reduce-scatter."""

    def __init__(self):
        self.rounds = 0

    def ddp_hook(self, state, bucket):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        self.rounds += bucket.is_last()
        return allreduce_hook(None, bucket)

    def wrap_reduce_scatter(self):
        real = dist.reduce_scatter_single

        def counted(*args, **kwargs):
            self.rounds += 1
            return real(*args, **kwargs)
        dist.reduce_scatter_single = counted


def build_model(loss, wrap):
    if loss == "coca":
        return create_coca_model(patch_dropout=0.3)
    cfg = load_config("naflex-tiny")
    cfg["nonscalar_logit_scale"] = wrap != "ddp"  # fully_shard takes no 0-dim parameters (upstream's FSDP does so)
    return create_model(cfg, siglip=loss == "siglip", patch_dropout=0.3)


def make_task(loss, options, rank, world, wrap, counter, find_unused=False):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)  # identical weights on every rank, as DDP and FSDP require
    model = build_model(loss, wrap)
    task = create_task(model, loss=loss, rank=rank, world_size=world, **options)
    if wrap == "ddp":
        task.trainable_module = DDP(model, find_unused_parameters=find_unused)
        task.trainable_module.register_comm_hook(None, counter.ddp_hook)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cpu", (world,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if wrap == "fsdp2-bf16" else None,
                                      reduce_dtype=torch.float32)  # upstream's, for its --precision
        for block in [*model.visual.trunk.blocks, *model.transformer.resblocks]:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
    return task


def _full(grads):
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in grads.items()}


def run_case(rank, world, wrap, loss, options, split, mode, step, counter, find_unused=False):
    task = make_task(loss, options, rank, world, wrap, counter, find_unused)
    task.train()
    spec = window_spec(loss)
    batches = random_window(split, seed=100 + rank, spec=spec)  # each rank its own examples
    seeds = [1000 * (rank + 1) + j for j in range(len(split))]
    counter.rounds = 0
    reference, _ = full_batch_grads(task, batches, seeds, chunked=True)
    ref_rounds, counter.rounds = counter.rounds, 0
    args = SimpleNamespace(accum_freq=len(split), batch_size=4, naflex_loss_scale="linear", grad_clip_norm=None)
    grads, _, n = accumulated_grads(step, task, batches, seeds, args)
    rounds = counter.rounds
    scale = window_loss_scale(list(split), 4, "linear", naflex=spec.images == "naflex")
    err, worst, ratios = compare(_full(grads), _full(reference), scale)
    tower_tol, logit_tol = TOLERANCE.get(wrap, (1e-5, 1e-5))
    ok = (err <= tower_tol and all(abs(r - 1) <= logit_tol for r in ratios.values()) and n == sum(split)
          and rounds == ref_rounds)
    return {"rank": rank, "wrap": wrap, "mode": mode, "loss": loss, **options, "split": list(split),
            "window_scale": scale, "tower_rel_err": err, "worst_param": worst, "logit_ratios": ratios,
            "reduction_rounds": rounds, "reference_rounds": ref_rounds, "passed": ok}


def parse_args(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("--wrap", choices=tuple(CASES), nargs="+", default=["ddp"])
    parser.add_argument("--find-unused-parameters", action="store_true")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--bug", default=None, help="a reference bug to run in both modes instead of ours")
    parser.add_argument("--step", default=None, help="MODULE:FUNCTION to audit instead of ours")
    args = parser.parse_args(argv)
    if args.step is not None:
        module, _, name = args.step.partition(":")
        args.steps = {args.step: getattr(importlib.import_module(module), name)}
    elif args.bug is not None:
        args.steps = {mode: bug_step(args.bug, mode) for mode in STEPS}
    else:
        args.steps = STEPS
    return args


def main() -> int:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="Grad strides do not match")  # DDP perf note on a [1,1,C] token
    warnings.filterwarnings("ignore", category=FutureWarning)
    groups = [[]]
    for arg in sys.argv[1:]:
        groups.append([]) if arg == "--then" else groups[-1].append(arg)
    jobs = [parse_args(group) for group in groups]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    counter = Counter()
    if any(wrap.startswith("fsdp2") for args in jobs for wrap in args.wrap):
        counter.wrap_reduce_scatter()
    failed = 0
    for job, args in enumerate(jobs):
        for wrap in args.wrap:
            for mode, step in args.steps.items():
                for loss, options, split in CASES[wrap][:2] if args.quick else CASES[wrap]:
                    result = run_case(rank, world, wrap, loss, options, split, mode, step, counter,
                                      args.find_unused_parameters)
                    gathered = [None] * world
                    dist.all_gather_object(gathered, {"job": job, **result})
                    if rank == 0:
                        for r in gathered:
                            print(json.dumps(r), flush=True)
                    failed += sum(not r["passed"] for r in gathered)
    dist.barrier()  # no rank tears gloo down while another is still in a collective
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Every result is printed and the status is known: skip interpreter teardown, where torch's gloo/FSDP2
    # threads once aborted a finished rank ("terminate called without an active exception", SIGABRT).
    os._exit(code)
