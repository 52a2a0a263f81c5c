"""Subcommands of the ``naflex-accum`` console script; each module has ``main(argv, prog)``."""
