"""A pytest plugin for upstream's own test sessions (``integration/test_upstream_suite.py``, both of them):
the checkpoints a test's training run left under ``./logs`` go when the test ends, so a session holds one
test's (up to 3 GB, CoCa's) rather than all of them at once. No test of upstream's reads another's."""
from pathlib import Path


def pytest_runtest_teardown(item, nextitem):
    for checkpoint in Path("logs").glob("*/checkpoints/*.pt"):
        checkpoint.unlink(missing_ok=True)
