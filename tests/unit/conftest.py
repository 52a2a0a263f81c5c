"""The unit tier's rule, enforced: a unit test runs in this one process.

It starts no subprocess, forks no DataLoader worker and joins no process group; such a test belongs in
tests/integration/. A unit test that does, in its body or in any fixture it sets up, fails naming what it
started.
"""
import os
import subprocess

import pytest

_started = []
_execute_child = subprocess.Popen._execute_child


def _recording_execute_child(self, args, *rest, **kwargs):
    _started.append(f"a subprocess ({args if isinstance(args, str) else ' '.join(map(str, args))[:80]})")
    return _execute_child(self, args, *rest, **kwargs)


# Recording only: integration tests that share this process are not affected.
subprocess.Popen._execute_child = _recording_execute_child
os.register_at_fork(after_in_parent=lambda: _started.append("a forked process (a DataLoader worker?)"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    _started.clear()  # before every fixture of this test, module-scoped ones included
    yield


@pytest.fixture(autouse=True)
def _one_process():
    yield
    if _started:
        pytest.fail(f"a unit test started {_started[0]}; it belongs in tests/integration/", pytrace=False)
