"""A worker's death reported while the main thread formats a log record: recorded, raised at the next batch.

torch's SIGCHLD handler raises wherever the main thread is; raised inside ``logging``'s
formatting, the error is printed as a "--- Logging error ---" traceback and dropped.
Here a stand-in for torch's handler raises torch's message, and the signal is sent from
inside a record's formatting, then inside a batch wait. Prints what happened to each.
"""
import logging
import os
import signal
import sys

from naflex_accum.data import workers


def torch_like_handler(signum, frame):
    raise RuntimeError("DataLoader worker (pid 12345) is killed by signal: Killed.")


def signal_here():
    os.kill(os.getpid(), signal.SIGCHLD)
    for _ in range(10000):  # the handler runs at the interpreter's next check, still in the caller
        pass


class SignalsWhenFormatted:
    def __str__(self):
        signal_here()
        return "formatted"


def main():
    logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(message)s")
    signal.signal(signal.SIGCHLD, torch_like_handler)
    workers._defer_sigchld()
    logging.info("record: %s", SignalsWhenFormatted())
    try:
        workers.raise_pending()
        print("next batch: nothing raised")
    except RuntimeError as exc:
        print(f"next batch: raised {exc}")
    try:
        with workers.Watch().waiting():
            signal_here()
        print("in a batch wait: nothing raised")
    except RuntimeError as exc:
        print(f"in a batch wait: raised {exc}")


if __name__ == "__main__":
    main()
