"""--dist-timeout, how long a collective waits on a peer (train/ending/distributed.py): seconds above 0, else one line;
and three pieces of train/ending/liveness.py: a store call's bound, which collective errors are a peer's, and ranks
that take a roll call at once.

The ranks themselves (a rank that fails, freezes or is killed) run for real in integration/test_rank_failures.py.
"""

import pytest


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf"])
def test_dist_timeout_must_be_seconds_above_0(value):
    from naflex_accum.errors import UsageError
    from naflex_accum.train.config.params import parse_args

    with pytest.raises(UsageError, match=r"--dist-timeout must be a number of seconds > 0"):
        parse_args(["--train-data", "x.tar", "--dist-timeout", value])


def test_a_store_call_without_an_answer_is_stuck_on_every_python(monkeypatch):
    """Future.result's timeout is the builtin TimeoutError only from Python 3.11 (on 3.10 it escaped ``STUCK``: a
    frozen store host gave a traceback and exit 1); a store's own error is a ``ConnectionError``. After either, the
    store is not asked again: each call to a frozen one would wait ``ACK_WAIT`` s more."""
    import concurrent.futures
    import threading

    import torch.distributed as dist

    from naflex_accum.train.ending import liveness

    class FutureTimeout(Exception):  # Python 3.10's concurrent.futures.TimeoutError
        pass
    monkeypatch.setattr(concurrent.futures, "TimeoutError", FutureTimeout)
    monkeypatch.setattr(concurrent.futures._base, "TimeoutError", FutureTimeout)
    monkeypatch.setattr(liveness, "ACK_WAIT", 0.1)

    def fresh():
        bare = object.__new__(liveness.Liveness)
        bare.stuck = None
        return bare.ask
    ask, release, asked = fresh(), threading.Event(), []
    with pytest.raises(TimeoutError, match="the job's store"):
        ask(lambda: release.wait(10))
    release.set()
    with pytest.raises(TimeoutError, match="the job's store"):
        ask(lambda: asked.append(1))
    assert not asked

    def closed():
        raise dist.DistError("connection closed")
    ask = fresh()
    with pytest.raises(ConnectionError):
        ask(closed)
    with pytest.raises(ConnectionError):
        ask(lambda: asked.append(1))
    assert not asked and fresh()(lambda: 7) == 7


def test_a_collective_that_a_timeout_closed_is_a_peers_failure_not_a_bug():
    """What gloo raises on a rank that comes back from a freeze (SIGSTOP) after its peers timed out."""
    from naflex_accum.train.ending.liveness import own_failure

    assert own_failure(RuntimeError("Application timeout caused pair closure"), 0) is None
    assert own_failure(RuntimeError("an injected bug"), 0).code == 1


def test_ranks_that_take_a_roll_call_at_once_hear_each_other():
    """SLURM signals every task at once, and each rank's listener takes a roll call (a save needs every rank); none
    is then free to answer another's. A rank in a roll call must count as present, else ranks take each other for
    frozen (exit 74, the stop request lost): here the listeners are stopped, so only the roll calls can tell."""
    import threading
    from types import SimpleNamespace

    import torch.distributed as dist

    from naflex_accum.train.ending.liveness import Liveness

    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)
    ranks = {}
    for rank in (0, 1):  # off the main thread: no signal handler is installed
        made = threading.Thread(target=lambda r=rank: ranks.update({r: Liveness(
            SimpleNamespace(rank=r, world_size=2), ("127.0.0.1", store.port), 5.0, "test")}))
        made.start()
        made.join()
    for peers in ranks.values():
        peers.closed.set()
        peers.thread.join()
    found = {}
    calls = [threading.Thread(target=lambda r=r: found.update({r: ranks[r].missing()})) for r in ranks]
    for call in calls:
        call.start()
    for call in calls:
        call.join()
    for peers in ranks.values():
        peers.close(ok=False)
    assert found == {0: [], 1: []}
