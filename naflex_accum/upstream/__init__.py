"""Upstream open_clip main with the fixed step: the second way to use the package (``python -m
naflex_accum.openclip``, ``naflex_accum.install``).

Invariant: importing any of this patches nothing; the patch goes in only where the installed upstream's contract
is one the step speaks (``patch.gate``), and the runner trains only settings upstream can take, after the step
passed its audit on the run's own task. Modules: docs/architecture.md.
"""
