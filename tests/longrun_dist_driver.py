"""Run under torchrun: ``naflex-accum train`` with the training loop's collectives recorded per optimizer
step, and SIGUSR1 sent to one rank only at one microbatch ($STOP_RANK, $STOP_MICROBATCH).

Writes $EVENTS_DIR/rank<R>.json: the exit code and every collective called from naflex_accum.train,
as [steps completed when called, operation, calling module].
"""
import json
import os
import signal
import sys

import naflex_accum.commands.train  # noqa: F401 (first: it sets torch's C++ log level as the CLI does)
import torch
import torch.distributed as dist

torch.set_num_threads(1)
OPS = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list", "barrier",
       "gather_object", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor")
events = []


def caller_module(depth=2):
    frame = sys._getframe(depth)
    return frame.f_globals.get("__name__", "")


def recording(name, fn):
    def wrapper(*args, **kwargs):
        direct = caller_module()
        if not direct.startswith("torch."):  # not a collective's own inner calls
            frame, module = sys._getframe(1), direct
            while module == "naflex_accum.train.ending.distributed" and frame.f_back is not None:
                frame = frame.f_back
                module = frame.f_globals.get("__name__", "")
            if module.startswith("naflex_accum.train"):
                events.append([steps[-1].steps if steps else 0, name, module])
        return fn(*args, **kwargs)
    return wrapper


for op in OPS:
    setattr(dist, op, recording(op, getattr(dist, op)))

from counted_step import CountedStep  # noqa: E402
from naflex_accum.train import main as train_main  # noqa: E402

real_select = train_main.select_step
rank = int(os.environ["RANK"])


steps = []  # the run's step, counting its optimizer steps


def before(n):
    if rank == int(os.environ.get("STOP_RANK", -1)) and n == int(os.environ["STOP_MICROBATCH"]):
        os.kill(os.getpid(), signal.SIGUSR1)


def select(args):
    steps.append(CountedStep(real_select(args), before))
    return steps[-1]


train_main.select_step = select
code = train_main.main(sys.argv[1:])
with open(os.path.join(os.environ["EVENTS_DIR"], f"rank{rank}.json"), "w") as f:
    json.dump({"exit_code": code, "events": events}, f)
sys.exit(code)
