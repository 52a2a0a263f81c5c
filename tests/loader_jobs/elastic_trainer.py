"""``naflex-accum train ARGS`` recording, per rank, every batch's sample keys and every learning rate set.

    RECORD=FILE_PREFIX [STOP_AT=EPOCH:INDEX] [STOP_FILE=PATH] python elastic_trainer.py ARGS...

Writes FILE_PREFIX-rank<R>.json: ``["batch", epoch, index, keys]`` for each batch the loop
took and ``["lr", position, lr]`` for each rate set. With STOP_AT, rank 0 writes STOP_FILE
(the run folder's STOP) when it takes that batch (its index in the segment the run goes through), so the
run stops after its optimizer step.
"""
import json
import os
import sys
from pathlib import Path

import naflex_accum.commands.train  # noqa: F401 (first: it sets torch's C++ log level as the CLI does)
import torch

from naflex_accum.data import loader
from naflex_accum.train import main

torch.set_num_threads(1)
rank, records = int(os.environ.get("RANK", "0")), []
stop_at = [int(x) for x in os.environ["STOP_AT"].split(":")] if os.environ.get("STOP_AT") else None
real_iter, real_scheduler = loader.TrainLoader.iter_meta, main.make_scheduler


def iter_meta(self):
    for batch, meta in real_iter(self):
        records.append(["batch", self.epoch, meta["index"], meta["keys"]])
        if stop_at == [self.epoch, meta["index"]] and rank == 0:
            Path(os.environ["STOP_FILE"]).touch()
        yield batch, meta


def make_scheduler(*args, **kwargs):
    scheduler = real_scheduler(*args, **kwargs)

    def recorded(position):
        lr = scheduler(position)
        records.append(["lr", float(position), float(lr)])
        return lr
    return recorded


loader.TrainLoader.iter_meta, main.make_scheduler = iter_meta, make_scheduler

from naflex_accum import cli  # noqa: E402

try:
    code = cli.entry(["train", *sys.argv[1:]])
finally:
    Path(f"{os.environ['RECORD']}-rank{rank}.json").write_text(json.dumps(records))
sys.exit(code)
