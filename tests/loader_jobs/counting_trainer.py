"""``naflex-accum train ARGS`` counting FSDP2's reduce-scatter calls and the optimizer steps, per rank.

    RECORD=FILE_PREFIX python counting_trainer.py ARGS...   (under torchrun)

Writes FILE_PREFIX-rank<R>.json: {"reduce_scatters": N, "steps": S, "units": U}: U the fully_shard
units (blocks and the root), each of which reduce-scatters once per synced backward.
"""
import json
import os
import sys
from pathlib import Path

import naflex_accum.commands.train  # noqa: F401 (first: it sets torch's C++ log level as the CLI does)
import torch
import torch.distributed as dist

from naflex_accum.train import main
from naflex_accum.train.model import fsdp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: counted_step
from counted_step import CountedStep  # noqa: E402

torch.set_num_threads(1)
counts = {"reduce_scatters": 0, "steps": 0, "units": 0}
real_rs, real_shard, real_select = dist.reduce_scatter_single, fsdp.shard, main.select_step


def reduce_scatter(*args, **kwargs):
    counts["reduce_scatters"] += 1
    return real_rs(*args, **kwargs)


def shard(model, world, args):
    counts["units"] = len(fsdp._unit_modules(model)) + 1
    return real_shard(model, world, args)


def select_step(args):
    steps.append(CountedStep(real_select(args)))
    return steps[-1]


steps = []


dist.reduce_scatter_single, fsdp.shard, main.select_step = reduce_scatter, shard, select_step

from naflex_accum import cli  # noqa: E402

try:
    code = cli.entry(["train", *sys.argv[1:]])
finally:
    counts["steps"] = sum(step.steps for step in steps)
    Path(f"{os.environ['RECORD']}-rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(counts))
sys.exit(code)
