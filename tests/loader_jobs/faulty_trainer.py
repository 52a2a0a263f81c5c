"""``naflex-accum train ARGS`` with the data loader's hand-over or its workers changed, for the fault tests.

    python faulty_trainer.py HANDOVER [raise-at=N] -- ARGS...

HANDOVER: ``slots`` (recycled shared-memory slots, the default path) or ``fresh``
(every batch in fresh shared memory, the path of a pinned CUDA loader and of a
worker whose slots are all held). ``raise-at=N``: each worker's N-th batch
raises ``ValueError`` while it is built.
"""
import sys

from naflex_accum.data import handover, pipeline

mode, *opts = sys.argv[1:sys.argv.index("--")]
argv = sys.argv[sys.argv.index("--") + 1:]
if mode == "fresh":
    handover.MAX_SLOTS = 0
for opt in opts:
    if opt.startswith("raise-at="):
        at, build, calls = int(opt.split("=")[1]), pipeline._part, [0]

        def part(*args, **kwargs):  # what builds each of a worker's batch parts
            calls[0] += 1
            if calls[0] == at:
                raise ValueError(f"injected failure while building batch {at} of this worker")
            return build(*args, **kwargs)
        pipeline._part = part

from naflex_accum import cli  # noqa: E402

sys.exit(cli.entry(["train", *argv]))
