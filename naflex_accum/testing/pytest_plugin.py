"""A pytest plugin that runs a test session with the fixed step installed (for upstream open_clip's own tests).

    python -m pytest -p naflex_accum.testing.pytest_plugin TESTS...

Invariant: ``install()`` is in effect from ``pytest_configure`` to the session's end, and the summary counts the
fixed step's calls, so a session that never reached it cannot pass for a patched one. docs/upstream.md.
"""


# The package is imported inside the hooks: pytest loads a -p plugin before the tests' own conftest.py files
# have put the right open_clip on sys.path, and nothing of open_clip's may be imported before then.


def pytest_configure(config):
    from naflex_accum.upstream.patch import install  # in the hook: see above

    install()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    from naflex_accum.upstream.patch import describe, installed_step  # in the hook: see above

    step = installed_step()
    if step is None:
        terminalreporter.write_line("naflex-accum: the fixed step was no longer installed at the end of the session")
        return
    terminalreporter.write_line(f"naflex-accum: {describe()}; called {step.calls} times, "
                                f"{step.steps} optimizer steps")


def pytest_unconfigure(config):
    from naflex_accum.upstream.patch import uninstall  # in the hook: see above

    uninstall()
