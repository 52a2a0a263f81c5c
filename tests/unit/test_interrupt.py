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
