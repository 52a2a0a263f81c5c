"""What a run keeps: ``rundir`` (its folder), ``checkpoint``, ``saver`` (when, which), ``resume``, ``lineage``.

Invariant: nothing a user has is lost or overwritten: a checkpoint is whole or absent, a folder one live run's."""
