"""The built-in NaFlex CLIP/SigLIP trainer (``naflex-accum train``): the third way to use the package.

Invariant: what a user has (checkpoints, logs, a requeue) is never lost, and every optimizer step goes
through the accumulation step (``naflex_accum.accum``). Modules by concern:

- the run: ``main`` (build, train, evaluate, checkpoint), ``params`` (flags, presets), ``upstream_flags``
  (upstream's flags and what this trainer does with each), ``loop`` (one epoch), ``monitor`` (checks
  that do not wait for the device), ``lr``, ``finetune``, ``compile``, ``fsdp``, ``evaluate``,
  ``zeroshot``, ``logs`` and ``report`` (console, ``out.log``, tensorboard, wandb), ``summary`` (the
  lines a run ends with);
- what is kept: ``rundir`` (the run folder), ``checkpoint`` (files, their CRC-32s),
  ``saver`` (when which checkpoint is written and kept), ``resume`` (state in and out), ``lineage``
  (branches after a rollback);
- how it ends: ``preempt`` (stop requests), ``exits`` (exit statuses), ``distributed`` (process group),
  ``peers``, ``channel``, ``watchdog`` and ``storehost`` (every rank heard, a frozen one found).
"""
