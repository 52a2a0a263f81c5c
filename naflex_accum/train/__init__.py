"""The built-in NaFlex CLIP/SigLIP trainer (``naflex-accum train``): the third way to use the package.

Invariant: what a user has (checkpoints, logs, a requeue) is never lost, and every optimizer step goes
through the accumulation step (``naflex_accum.accum``). Here: ``main`` (build, train, evaluate,
checkpoint), ``loop`` (one epoch), ``monitor`` (checks that do not wait for the device), ``lr``. The run's
parts, each sub-package's ``__init__`` stating its invariant: ``config/`` (the flags), ``model/`` (what
trains), ``eval/``, ``output/`` (what a run says), ``kept/`` (what a run keeps), ``ending/`` (how a run ends:
signals, exit classes, ranks).
"""
