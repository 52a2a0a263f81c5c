"""Upstream open_clip main with the fixed step: the second way to use the package (``python -m
naflex_accum.openclip``, ``naflex_accum.install``).

Invariant: importing any of this patches nothing; the patch goes in only where the installed upstream's
contract is one the step speaks (``patch.gate``), and the runner trains only settings upstream can take,
after the installed step passed its audit on the run's own task (a run that never calls it records so),
and a start that fails before its first step leaves no run folder it made.
Modules: ``probe`` (the installed upstream's contract), ``patch`` (install and uninstall), ``runner``
(the runner), ``cmdline`` (its command line), ``preflight`` (what it refuses before upstream's main
starts; ``locks``, the tower locks), ``startup`` (a start that fails before its first step),
``selfcheck`` (its audit before training), ``audit`` (accumulated gradients against one
full-batch backward), ``faults`` (which of upstream's faults a step has), ``fingerprint`` (hashes of the
upstream code the patch relies on), ``tiny_tasks`` (tiny tasks built by upstream's own factory).
"""
