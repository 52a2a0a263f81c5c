"""The accumulation step and its maths: the first way to use the package (``naflex_accum.train_step_eager``).

Invariant: how a window is split into microbatches is a memory-layout choice; the accumulated gradient of
every parameter is the window scale times one full-batch backward, to fp32 round-off. Modules: ``step``
(upstream's step contract, the checks, the order of work, the hooks), ``cached_loss`` and ``replay`` (the
two modes; ``modes`` says which runs by default), ``window`` (what a step keeps while a window fills),
``scales`` (the window scale, pure maths), ``rng`` (random state captured and replayed), ``sync``
(gradient sync off for all but the last backward), ``contract`` (upstream's contract generations).
"""
