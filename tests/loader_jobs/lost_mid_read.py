"""A worker killed while the main thread reads its batch: the read's error is turned into one naming the worker.

A killed worker's sockets close before the kernel lets it be reaped, so the read of its
batch can fail with ``ConnectionResetError`` while torch's own check still sees it
alive and re-raises that error (or, with a CUDA loader, the pin thread dies of it and
torch raises "Pin memory thread exited unexpectedly"). Here a stand-in iterator over
one real worker process does the same: it kills the worker and raises the read's
error at once, before the worker can be reaped. Then a read fails while the worker
lives: that error must pass through as it is. Last, the pin thread's error with the
worker killed. Prints what the loader raised each time and the line
``workers.failure`` makes of it.
"""
import os
import signal
import time

from naflex_accum.data import delivery, workers


class FailingRead:
    def __init__(self, kill: bool, error: Exception):
        self.kill, self.error = kill, error
        self.multiprocessing_context, self.num_workers = workers.context(), 1  # a DataLoader's, as workers.of reads
        self.multiprocessing_context.Process(target=time.sleep, args=(60,), daemon=True).start()

    def __iter__(self):
        return self

    def __next__(self):
        if self.kill:
            os.kill(workers.of(self)[0].pid, signal.SIGKILL)
        raise self.error

    def _shutdown_workers(self):
        pass


def read(what: str, kill: bool, error: Exception) -> None:
    source = FailingRead(kill, error)
    try:
        next(delivery.iterate(source, False, receive=None))
        print(f"{what}: nothing raised")
    except Exception as exc:
        print(f"{what}: raised {type(exc).__name__}: {exc}")
        print(f"{what}: failure: {workers.failure(exc)}")
    finally:
        workers.stop(workers.of(source))


def main():
    workers.LOST_GRACE = 1.0
    reset = ConnectionResetError(104, "Connection reset by peer")
    read("killed", kill=True, error=reset)
    read("alive", kill=False, error=reset)
    read("pinned", kill=True, error=RuntimeError(workers.PIN_THREAD_DIED))  # the read failed in the pin thread
    workers.stop_all()


if __name__ == "__main__":
    main()
