"""The accumulation step and its maths: the first way to use the package (``naflex_accum.train_step_eager``).

Invariant: how a window is split into microbatches is a memory-layout choice; the accumulated gradient of every
parameter is the window scale times one full-batch backward, to fp32 round-off. Modules: docs/architecture.md.
"""
