"""Upstream open_clip main with the fixed step: the second way to use the package (``python -m
naflex_accum.openclip``, ``naflex_accum.install``).

Invariant: importing any of this patches nothing; the patch goes in only where the installed upstream's
contract is one the step speaks (``patch.gate``), and the runner trains only after the installed step
passed its audit on the run's own task. Modules: ``probe`` (the installed upstream's contract),
``patch`` (install and uninstall), ``runner`` (the runner), ``selfcheck`` (its audit before training),
``audit`` (accumulated gradients against one full-batch backward), ``faults`` (which of upstream's
faults a step has), ``fingerprint`` (hashes of the upstream code the patch relies on), ``tiny_tasks``
(tiny tasks built by upstream's own factory).
"""
