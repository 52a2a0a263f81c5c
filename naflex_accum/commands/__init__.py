"""Subcommands of the ``naflex-accum`` console script: each module has ``main(argv, prog, ends_process)``.

``ends_process`` is true where the process ends with the command (the console script, ``python -m``); a
command that trains then leaves a scheduler's late SIGTERM ignored instead of restoring the old handlers
(``train.ending.preempt``). A command that runs nothing of the kind takes it and ignores it.
"""
