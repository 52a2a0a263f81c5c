"""interrupt.py: a Ctrl-C inside a ``deferred`` block acts once the block has ended, through the handler before."""
import signal

import pytest

from naflex_accum.interrupt import deferred


@pytest.fixture
def python_ctrl_c():
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_a_ctrl_c_in_a_deferred_block_acts_when_it_ends(python_ctrl_c):
    ran = []
    with pytest.raises(KeyboardInterrupt):
        with deferred():
            signal.raise_signal(signal.SIGINT)
            ran.append("the rest of the block")
    assert ran == ["the rest of the block"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_deferred_block_without_ctrl_c_changes_nothing(python_ctrl_c):
    with deferred():
        pass
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_install_replaces_only_pythons_own_handler_and_only_in_the_main_thread(python_ctrl_c):
    """Importing naflex_accum.cli installs it: a program's own handler, or an import from a thread, is left as it was."""
    import threading

    from naflex_accum.interrupt import install

    def mine(signum, frame):
        pass
    signal.signal(signal.SIGINT, mine)
    install()
    assert signal.getsignal(signal.SIGINT) is mine
    signal.signal(signal.SIGINT, signal.default_int_handler)
    errors = []
    thread = threading.Thread(target=_record, args=(errors, install))
    thread.start()
    thread.join()
    assert errors == [] and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    install()
    assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler


def _record(errors, call):
    try:
        call()
    except Exception as exc:  # what the thread met
        errors.append(exc)
