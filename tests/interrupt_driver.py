"""A console command with a Ctrl-C at a chosen moment: SIGINT to its whole process group, as a terminal sends it.

    python -m interrupt_driver MOMENT COMMAND ARGS...     (tests/ on the path; for test_interrupt.py)

MOMENT: ``dataclass-import`` (as the command's modules import, inside an exec() of a string, as a
dataclass makes its methods), ``worker-start`` (sent by the second loader worker, right after its fork),
``evaluation`` (after the first held-out batch), ``checkpoint-write`` (inside the bytes of the second
checkpoint written), ``export-write`` (as the export's weights file is written). The command then runs as
``python -m naflex_accum.cli`` runs it (``naflex_accum.cli.entry``, under ``-m``).
"""
import os
import signal
import sys

from naflex_accum import cli


def ctrl_c() -> None:
    os.killpg(os.getpgrp(), signal.SIGINT)


def on_call(owner, name: str, nth: int) -> None:
    """Press Ctrl-C as ``owner.name`` is called for the ``nth`` time."""
    real, calls = getattr(owner, name), [0]

    def hooked(*args, **kwargs):
        calls[0] += 1
        if calls[0] == nth:
            ctrl_c()
        return real(*args, **kwargs)
    setattr(owner, name, hooked)


def dataclass_import() -> None:
    """As the command's modules import: inside an exec() of a string, as a dataclass makes its methods."""
    real = cli._module

    def module(name):
        exec("import os, signal\nos.killpg(os.getpgrp(), signal.SIGINT)\nfor _ in range(10**6): pass")
        return real(name)
    cli._module = module


def worker_start() -> None:
    forks = [0]

    def child() -> None:
        if forks[0] == 2:
            ctrl_c()
    os.register_at_fork(before=lambda: forks.__setitem__(0, forks[0] + 1), after_in_child=child)


def evaluation() -> None:
    from naflex_accum.train import main

    def after_first(batches):
        for i, batch in enumerate(batches):
            yield batch
            if i == 0:
                ctrl_c()
    real = main.evaluate
    main.evaluate = lambda task, loader, *rest: real(task, after_first(loader), *rest)


def checkpoint_write() -> None:
    from naflex_accum.train.kept import checkpoint

    saves, real_save, real_write = [0], checkpoint._save, checkpoint._Writer.write

    def save(*args, **kwargs):
        saves[0] += 1
        return real_save(*args, **kwargs)

    def write(self, data):
        self.writes = getattr(self, "writes", 0) + 1
        if saves[0] == 2 and self.writes == 3:
            ctrl_c()
        return real_write(self, data)
    checkpoint._save, checkpoint._Writer.write = save, write


def export_write() -> None:
    from naflex_accum.commands import export

    on_call(export, "save_file", 1)


MOMENTS = {"dataclass-import": dataclass_import, "worker-start": worker_start, "evaluation": evaluation,
           "checkpoint-write": checkpoint_write, "export-write": export_write}

if __name__ == "__main__":
    MOMENTS[sys.argv[1]]()
    sys.exit(cli.entry(sys.argv[2:]))
