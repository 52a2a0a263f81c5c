"""A pytest plugin that runs a test session with the fixed step installed (for upstream open_clip's own tests).

    python -m pytest -p naflex_accum.testing.pytest_plugin TESTS...

Invariant: ``naflex_accum.install()`` (``upstream.patch.install``) is in effect from ``pytest_configure``,
before any test module is imported (so a test that imports upstream's step by
name gets ours), to the end of the session, and is taken out then. The
terminal summary says how often the fixed step was called and how many
optimizer steps it made, so a session that never reached it cannot pass for
a patched one. Mode: ``$NAFLEX_ACCUM_MODE``, as for the runner.
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
