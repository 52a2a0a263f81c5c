"""What a run says: ``logs`` (console, ``out.log``), ``report`` (tensorboard, wandb), ``summary`` (its last lines).

Invariant: output only reports: a sink that fails names itself in one line and changes no number of the run."""
