"""``naflex-accum train ARGS`` with one rank's faults made to order, for the tests of ranks that fail.

    RECORD=FOLDER [BREAK_RANK=R BREAK_AFTER=N] [FAIL_AT_START=R] [SLOW=SECONDS] python rank_faults.py ARGS...

Run under torchrun, or as srun starts the ranks. Writes FOLDER/rank<R>.pid (this process's pid) at the
start and FOLDER/rank<R>.steps (the optimizer steps done, rewritten after each), so that a test can
stop, kill or signal a rank once it trains. BREAK_RANK: that rank's images stop decoding after its
loader decoded BREAK_AFTER of them, and its loader gives up after 5 failures in a row (the UsageError a
corrupt data set gives; the other rank's data is sound). FAIL_AT_START: rank R raises a UsageError
while it builds its data loader (the other rank is then in its first collective, or ahead); ``all``:
every rank raises the same one; ``bug:R``: rank R raises a TypeError. SLOW_START: every rank takes that
many seconds longer to build its loader. SLOW: rank 0's first checkpoint write takes SLOW seconds longer
(it touches FOLDER/slow.started as it begins); SLOW_EVAL: so does each of its evaluations. LATE: rank 0
starts its command that many seconds late (a slower node). RANK_1_FLAGS: flags rank 1 adds to its command.
"""
import os
import sys
import time
from pathlib import Path

import naflex_accum.commands.train  # noqa: F401 (first: it sets torch's C++ log level as the CLI does)
import torch

from naflex_accum.data import fill, pipeline
from naflex_accum.errors import UsageError
from naflex_accum.train import main
from naflex_accum.train.kept import saver

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: counted_step
from counted_step import CountedStep  # noqa: E402

torch.set_num_threads(1)
rank, record = int(os.environ.get("RANK", "0")), Path(os.environ["RECORD"])
(record / f"rank{rank}.pid").write_text(str(os.getpid()))

if rank == int(os.environ.get("BREAK_RANK", -1)):
    fill.MAX_CONSECUTIVE_FAILURES = 5
    real_decode, decoded = pipeline.decode_for_seq, [0]

    def decode_for_seq(*args, **kwargs):  # runs in the loader's worker process
        decoded[0] += 1
        if decoded[0] > int(os.environ["BREAK_AFTER"]):
            raise OSError("image file is truncated (injected)")
        return real_decode(*args, **kwargs)
    pipeline.decode_for_seq = decode_for_seq

real_build_data = main.build_data


def build_data(*args, **kwargs):
    time.sleep(float(os.environ.get("SLOW_START", 0)))
    failing = os.environ.get("FAIL_AT_START", "")
    if failing == "all":
        raise UsageError("--train-data: the shards cannot be read (injected)")
    if failing == str(rank):
        raise UsageError(f"--train-data: rank {rank}'s shards cannot be read (injected)")
    if failing == f"bug:{rank}":
        raise TypeError("an injected bug")
    return real_build_data(*args, **kwargs)


main.build_data = build_data

slow_eval = float(os.environ.get("SLOW_EVAL", 0))
if slow_eval and rank == 0:
    real_evaluate = main.evaluate

    def evaluate(*args, **kwargs):
        time.sleep(slow_eval)
        return real_evaluate(*args, **kwargs)
    main.evaluate = evaluate

slow = float(os.environ.get("SLOW", 0))
if slow and rank == 0:
    real_save, saves = saver.save_checkpoint, [0]

    def save_checkpoint(*args, **kwargs):
        saves[0] += 1
        if saves[0] == 1:
            (record / "slow.started").touch()
            time.sleep(slow)
        return real_save(*args, **kwargs)
    saver.save_checkpoint = save_checkpoint

real_select = main.select_step


class Recorded(CountedStep):
    """The run's step, writing how many optimizer steps this rank has made after each one."""

    def __call__(self, *a, **k):
        result = super().__call__(*a, **k)
        if result is not None:
            (record / f"rank{rank}.steps").write_text(str(self.steps))
        return result


def select_step(args):
    return Recorded(real_select(args))


main.select_step = select_step

from naflex_accum import cli  # noqa: E402

if rank == 0:
    time.sleep(float(os.environ.get("LATE", 0)))
extra = os.environ.get("RANK_1_FLAGS", "").split() if rank == 1 else []
sys.exit(cli.entry(["train", *sys.argv[1:], *extra]))
