"""What a start of upstream's ``main`` leaves when it fails: before its first step, one line and no run folder it made.

A stand-in ``open_clip_train.main`` sets up as upstream's does (``init_distributed_device``, then the run folder
``--logs/--name``, refusing with -1 if its ``out.log`` is there, then ``setup_logging`` opening ``out.log``, then
``checkpoints/``, ``tensorboard/`` and ``params.txt``) and then fails the way a test says, after a step or before
any. The pinned upstreams run in ``integration/test_runner_failed_start.py``.
"""
import argparse
import contextlib
import logging
import os
import sys
import types

import pytest
import torch

from naflex_accum import openclip

ERROR = "naflex_accum.openclip: error: upstream's main stopped before its first step: "


@pytest.fixture
def upstream_main(stand_in, upstream_train, monkeypatch, tmp_path):
    """The stand-in main's module; ``module.then(args)`` is what it does once set up."""
    monkeypatch.setenv("NAFLEX_ACCUM_VERIFY", "0")  # 3.3.0 has no upstream task classes to check with
    monkeypatch.chdir(tmp_path)
    module = types.ModuleType("open_clip_train.main")
    handlers = []

    def parse_args(argv):
        parser = argparse.ArgumentParser()
        parser.add_argument("--logs", default="logs")
        parser.add_argument("--name", default="run")
        parser.add_argument("--rank", type=int, default=0)
        return parser.parse_args(argv, argparse.Namespace(log_local=False))

    def init_distributed_device(args):
        args.world_size, args.distributed = 2 if args.rank else 1, bool(args.rank)
        return "cpu"

    def setup_logging(path, level):
        if path:
            handlers.append(logging.FileHandler(path))
            logging.root.addHandler(handlers[-1])

    def main(argv):
        args = module.parse_args(argv)
        module.init_distributed_device(args)
        folder = os.path.join(args.logs, args.name)
        if args.rank == 0:
            os.makedirs(folder, exist_ok=True)
            if os.path.exists(os.path.join(folder, "out.log")):
                print("Error. Experiment already exists. Use --name {} to specify a new experiment.")
                return -1
        module.setup_logging(os.path.join(folder, "out.log") if args.rank == 0 else None, logging.INFO)
        if args.rank == 0:
            for made in ("checkpoints", "tensorboard"):
                os.makedirs(os.path.join(folder, made), exist_ok=True)
            with open(os.path.join(folder, "params.txt"), "w") as params:
                params.write(f"name: {args.name}\n")
        return module.then(args)
    module.parse_args, module.init_distributed_device, module.setup_logging = parse_args, init_distributed_device, \
        setup_logging
    module.main = main
    monkeypatch.setitem(sys.modules, "open_clip_train.main", module)
    yield module
    for handler in handlers:
        logging.root.removeHandler(handler)
        handler.close()


def _boom(args):
    raise RuntimeError("boom\nsecond line")


def _one_line(capsys, start=ERROR) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines and lines[-1].startswith(start), lines
    assert not [line for line in lines[:-1] if "error" in line], lines
    return lines[-1]


def test_a_failure_before_the_first_step_is_one_line_and_takes_its_run_folder(upstream_main, tmp_path, capsys):
    upstream_main.then = _boom
    assert openclip.main([]) == 1
    line = _one_line(capsys)
    assert line.startswith(f"{ERROR}RuntimeError: boom second line (upstream/test_startup.py:"), line
    assert line.endswith("; removed the run folder logs/run this start had created, so the same --name can start "
                         "again")
    assert not (tmp_path / "logs").exists()


def test_only_the_run_folder_goes(upstream_main, tmp_path, capsys):
    (tmp_path / "logs" / "other").mkdir(parents=True)
    upstream_main.then = _boom
    assert openclip.main([]) == 1
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["other"]


def test_a_run_folder_that_was_there_stays_with_the_traceback_in_its_log(upstream_main, tmp_path, capsys):
    (tmp_path / "logs" / "run").mkdir(parents=True)
    (tmp_path / "logs" / "run" / "notes.txt").write_text("mine")
    upstream_main.then = _boom
    assert openclip.main([]) == 1
    assert _one_line(capsys).endswith(f"; the run folder logs/run was there before this start and is kept (the "
                                      f"traceback is in {tmp_path / 'logs' / 'run' / 'out.log'})")
    assert (tmp_path / "logs" / "run" / "notes.txt").read_text() == "mine"
    log = (tmp_path / "logs" / "run" / "out.log").read_text()
    assert "Traceback" in log and "RuntimeError: boom" in log


def _optimizer_step(args):
    weight = torch.nn.Parameter(torch.ones(1))
    torch.optim.SGD([weight], lr=0.1).step()


def _fixed_step_call(args):
    with contextlib.suppress(Exception):  # called with nothing: counted, then it refuses
        sys.modules["open_clip_train.train"]._train_step_eager(*[None] * 7)


@pytest.mark.parametrize("step", [_optimizer_step, _fixed_step_call], ids=["optimizer", "fixed-step"])
def test_a_failure_after_a_step_is_upstreams_own_and_keeps_everything(upstream_main, tmp_path, capsys, step):
    def step_then_boom(args):
        step(args)
        _boom(args)
    upstream_main.then = step_then_boom
    with pytest.raises(RuntimeError, match="boom"):
        openclip.main([])
    assert (tmp_path / "logs" / "run" / "out.log").is_file()
    assert ERROR not in capsys.readouterr().err


def _files(folder):
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*"))


def test_a_file_under_checkpoints_keeps_the_folder(upstream_main, tmp_path, capsys):
    def save_then_boom(args):
        (tmp_path / "logs" / "run" / "checkpoints" / "epoch_0.pt").write_bytes(b"")
        _boom(args)
    upstream_main.then = save_then_boom
    assert openclip.main([]) == 1
    assert _one_line(capsys).endswith("; the run folder logs/run is kept: it holds checkpoints/ (this start's "
                                      "out.log and params.txt are removed, so the same --name can start again)")
    assert _files(tmp_path / "logs") == ["run", "run/checkpoints", "run/checkpoints/epoch_0.pt"]


@pytest.mark.parametrize("raised", [RuntimeError, KeyboardInterrupt], ids=["failed", "interrupted"])
def test_a_file_written_into_the_run_folder_while_it_starts_is_kept(upstream_main, tmp_path, capsys, raised):
    def write_then_stop(args):
        (tmp_path / "logs" / "run" / "NOTES.txt").write_text("mine")
        (tmp_path / "logs" / "run" / "tensorboard" / "mine.txt").write_text("mine too")
        raise raised("boom")
    upstream_main.then = write_then_stop
    if raised is KeyboardInterrupt:
        with pytest.raises(KeyboardInterrupt):
            openclip.main([])
    else:
        assert openclip.main([]) == 1
        assert _one_line(capsys).endswith("; the run folder logs/run is kept: it holds NOTES.txt, tensorboard/ (this "
                                          "start's out.log and params.txt are removed, so the same --name can start "
                                          "again)")
    assert _files(tmp_path / "logs") == ["run", "run/NOTES.txt", "run/tensorboard", "run/tensorboard/mine.txt"]
    assert (tmp_path / "logs" / "run" / "NOTES.txt").read_text() == "mine"


def test_the_levels_of_logs_this_start_made_go_when_empty(upstream_main, tmp_path, capsys):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "other").write_text("mine")
    upstream_main.then = _boom
    assert openclip.main(["--logs", "a/b/c/d"]) == 1
    assert _one_line(capsys).endswith("; removed the run folder a/b/c/d/run this start had created, so the same "
                                      "--name can start again")
    assert _files(tmp_path / "a") == ["other"]


@pytest.mark.parametrize("then", ["refused", "failed", "interrupted"])
def test_a_run_folder_another_start_made_after_this_one_began_is_not_touched(upstream_main, tmp_path, capsys, then):
    """Another start with the same --name makes the folder after this start listed --logs: this one must not take it."""
    setup = upstream_main.init_distributed_device

    def another_start_made_it(args):
        (tmp_path / "logs" / "run" / "checkpoints").mkdir(parents=True)
        (tmp_path / "logs" / "run" / "out.log").write_text("another start's\n")
        if then == "failed":
            raise RuntimeError("boom")
        if then == "interrupted":
            raise KeyboardInterrupt
        return setup(args)
    upstream_main.init_distributed_device = another_start_made_it
    upstream_main.then = _boom
    if then == "interrupted":
        with pytest.raises(KeyboardInterrupt):
            openclip.main([])
    else:
        assert openclip.main([]) == 1
    said = capsys.readouterr()
    if then == "refused":
        assert "Experiment already exists" in said.out
    if then == "failed":
        assert "; the run folder logs/run is kept: it was made after this start began and this start did not open " \
               "its log, so it may be another start's" in said.err, said.err
    assert _files(tmp_path / "logs") == ["run", "run/checkpoints", "run/out.log"]
    assert (tmp_path / "logs" / "run" / "out.log").read_text() == "another start's\n"


@pytest.mark.parametrize("returned,raised", [(-1, None), (None, KeyboardInterrupt)], ids=["refused", "interrupted"])
def test_a_start_that_ends_otherwise_before_its_first_step_leaves_no_folder_either(upstream_main, tmp_path, returned,
                                                                                 raised):
    def end(args):
        if raised:
            raise raised()
        return returned
    upstream_main.then = end
    if raised:
        with pytest.raises(raised):
            openclip.main([])
    else:
        assert openclip.main([]) == 1
    assert not (tmp_path / "logs").exists()


def test_another_rank_says_its_line_and_leaves_the_folder_to_the_rank_that_made_it(upstream_main, tmp_path, capsys):
    def made_by_rank_0(args):
        os.makedirs(tmp_path / "logs" / "run")  # just now, after this rank began
        _boom(args)
    upstream_main.then = made_by_rank_0
    assert openclip.main(["--rank", "1"]) == 1
    line = _one_line(capsys, "naflex_accum.openclip: error: upstream's main stopped before its first step on rank 1: "
                             "RuntimeError: boom")
    assert "folder" not in line
    assert (tmp_path / "logs" / "run").is_dir()
