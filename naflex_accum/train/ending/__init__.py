"""How a run ends: ``preempt`` (STOP file, signals), ``exits`` (exit statuses), ``distributed`` (the process group).

Invariant: every way a run ends has one exit status and one line, the same on every rank."""
