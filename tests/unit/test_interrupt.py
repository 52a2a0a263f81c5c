"""interrupt.py: a Ctrl-C inside a ``deferred`` block acts once the block has ended, through the handler before."""
import signal
import sys
import threading

import pytest

from naflex_accum.interrupt import deferred, quiet_fd_sharing_errors


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


def test_after_a_ctrl_c_a_thread_that_fails_while_the_stop_unwinds_prints_no_traceback(python_ctrl_c, capfd):
    """As a DataLoader's fd-sharing server thread does when the worker it serves is stopped mid-transfer."""
    import threading

    from naflex_accum.interrupt import install

    before = threading.excepthook
    threading.excepthook = threading.__excepthook__  # Python's own, which prints (pytest's would only warn)
    try:
        install()
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        thread = threading.Thread(target=_fail)
        thread.start()
        thread.join()
        assert "Traceback" not in capfd.readouterr().err
    finally:
        threading.excepthook = before


def _fail():
    raise ConnectionResetError(104, "Connection reset by peer")


def test_the_fd_sharing_servers_connection_error_is_quiet_and_other_threads_errors_are_not(monkeypatch):
    printed = []  # the threads whose errors reach the hook before (Python's own prints their traceback)
    monkeypatch.setattr(threading, "excepthook", lambda args: printed.append(args.thread.name))

    def _serve():  # what multiprocessing.resource_sharer's thread runs, its worker gone mid-handshake
        raise ConnectionResetError(104, "Connection reset by peer")

    def work():
        raise ConnectionResetError(104, "Connection reset by peer")
    quiet_fd_sharing_errors()
    quiet_fd_sharing_errors()  # twice: one hook
    for target in (_serve, work):
        thread = threading.Thread(target=target)
        thread.start()
        thread.join()
    assert [name.split(" ")[1] for name in printed] == ["(work)"], printed


def test_the_fd_sharing_servers_own_report_of_a_caught_error_is_quiet_too(monkeypatch):
    printed = []  # resource_sharer's _serve catches its error and hands it to sys.excepthook itself
    monkeypatch.setattr(sys, "excepthook", lambda kind, value, tb: printed.append(threading.current_thread().name))
    monkeypatch.setattr(threading, "excepthook", lambda args: None)  # not yet quieted: the hooks go in now

    def report():
        try:
            raise ConnectionResetError(104, "Connection reset by peer")
        except ConnectionError:
            sys.excepthook(*sys.exc_info())

    def _serve():
        report()

    def work():
        report()
    quiet_fd_sharing_errors()
    for target in (_serve, work):
        thread = threading.Thread(target=target)
        thread.start()
        thread.join()
    assert [name.split(" ")[1] for name in printed] == ["(work)"], printed
