"""The run's flags: ``params`` (the trainer's, ``--config`` presets, ``data_config``), ``upstream_flags`` (upstream's).

Invariant: every flag is checked once (the data flags by data/'s ``check_data_config``), before anything is built."""
