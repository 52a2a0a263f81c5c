"""The built-in NaFlex CLIP/SigLIP trainer (``naflex-accum train``): the third way to use the package.

Invariant: what a user has (checkpoints, logs, a requeue) is never lost, and every optimizer step goes
through the accumulation step (``naflex_accum.accum``). Each sub-package's ``__init__`` states its
invariant; docs/architecture.md maps the modules.
"""
