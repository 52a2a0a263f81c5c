"""The reference bugs, re-exported from the package (``naflex_accum.testing.bugs``) for ``--step bug_reference:...``."""
from naflex_accum.testing.bugs import *  # noqa: F401,F403
