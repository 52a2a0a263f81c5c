"""``python -m naflex_accum.openclip ARGS`` with a failure put into upstream's ``main``, to see what a start leaves.

    [torchrun ...] failing_start.py ARGS      (upstream's src first on PYTHONPATH)

$FAIL_AT says where upstream's ``main`` fails: ``get_data`` (its data set-up
raises, after the run folder and the model, before the first step),
``after_epoch`` (its ``train_one_epoch`` raises once it has trained an epoch,
before the checkpoint), or unset (nothing put in). The runner's refusal of DDP
on the CPU is lifted here, so that two CPU ranks reach upstream's DDP wrap,
which fails on every rank before the first step.
"""
import os
import sys

import open_clip_train.main as upstream

from naflex_accum.openclip import main
from naflex_accum.upstream import preflight


def get_data(*args, **kwargs):
    raise RuntimeError("injected: the data set-up failed\n(a second line of the message)")


def failing_after(train_one_epoch):
    def train_one_epoch_then_fail(*args, **kwargs):
        train_one_epoch(*args, **kwargs)
        raise RuntimeError("injected: failed after an epoch")
    return train_one_epoch_then_fail


if os.environ.get("FAIL_AT") == "get_data":
    upstream.get_data = get_data
elif os.environ.get("FAIL_AT") == "after_epoch":
    upstream.train_one_epoch = failing_after(upstream.train_one_epoch)
preflight.CHECKS = tuple(check for check in preflight.CHECKS if check.__name__ != "_ddp_on_cpu")
sys.exit(main(sys.argv[1:]))
