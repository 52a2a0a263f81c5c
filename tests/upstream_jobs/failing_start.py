"""``python -m naflex_accum.openclip ARGS`` with a failure put into upstream's ``main``, to see what a start leaves.

    [torchrun ...] failing_start.py ARGS      (upstream's src first on PYTHONPATH)

$FAIL_AT says where upstream's ``main`` fails: ``get_data`` (its data set-up
raises, after the run folder and the model, before the first step),
``get_data_after_notes`` (the same, once a user's ``NOTES.txt`` was written
into the run folder), ``after_epoch`` (its ``train_one_epoch`` raises once it
has trained an epoch, before the checkpoint), or unset (nothing put in).
$WAIT_FOR=PATH holds upstream's $WAIT_IN (``init_distributed_device``, which
the runner's listing of ``--logs`` precedes, or ``get_data``, after the run
folder) until PATH exists, once it has written ``waiting-in-$WAIT_IN`` in the
working folder: two starts can be made to meet at a given moment. The runner's
refusal of DDP on the CPU is lifted here, so that two
CPU ranks reach upstream's DDP wrap, which fails on every rank before the first
step.
"""
import os
import sys
import time

import open_clip_train.main as upstream

from naflex_accum.openclip import main
from naflex_accum.upstream import preflight


def get_data(*args, **kwargs):
    raise RuntimeError("injected: the data set-up failed\n(a second line of the message)")


def get_data_after_notes(args, *more, **kwargs):
    with open(os.path.join(args.logs, args.name, "NOTES.txt"), "w") as notes:
        notes.write("mine")
    get_data(args, *more, **kwargs)


def waiting_for(path, function):
    def function_later(*args, **kwargs):
        open(f"waiting-in-{function.__name__}", "w").close()
        for _ in range(6000):  # five minutes at most
            if os.path.exists(path):
                break
            time.sleep(0.05)
        return function(*args, **kwargs)
    return function_later


def failing_after(train_one_epoch):
    def train_one_epoch_then_fail(*args, **kwargs):
        train_one_epoch(*args, **kwargs)
        raise RuntimeError("injected: failed after an epoch")
    return train_one_epoch_then_fail


if os.environ.get("FAIL_AT") == "get_data":
    upstream.get_data = get_data
elif os.environ.get("FAIL_AT") == "get_data_after_notes":
    upstream.get_data = get_data_after_notes
elif os.environ.get("FAIL_AT") == "after_epoch":
    upstream.train_one_epoch = failing_after(upstream.train_one_epoch)
if os.environ.get("WAIT_FOR"):
    name = os.environ["WAIT_IN"]
    setattr(upstream, name, waiting_for(os.environ["WAIT_FOR"], getattr(upstream, name)))
preflight.CHECKS = tuple(check for check in preflight.CHECKS if check.__name__ != "_ddp_on_cpu")
sys.exit(main(sys.argv[1:]))
