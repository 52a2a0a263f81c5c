"""The upstream runner: ``naflex-accum openclip`` and ``python -m naflex_accum.openclip``.

On open_clip 3.3.0 it must stop with exit 2 and one line pointing to
``naflex-accum train``; with a stand-in of upstream's step (and a stand-in of
upstream's ``main``) it must hand ARGS over unchanged with our step in place,
and take the patch out afterwards.
"""

import sys
import types

import pytest
from upstream_stand_in import NAME, renamed_param_step

from naflex_accum import cli, openclip
from naflex_accum.upstream.patch import is_ours

ARGS = ["--use-naflex", "--accum-freq", "4", "--naflex-loss-scale", "linear", "--batch-size=256",
        "--train-data", "/data/{00000..00010}.tar", "--name", "a b"]


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def _skip_unless_3_3(module):
    if hasattr(module, NAME):
        pytest.skip("this open_clip has _train_step_eager (not 3.3.0)")


@pytest.fixture
def fake_upstream_main(monkeypatch):
    """``open_clip_train.main`` whose ``main`` records ARGS and which step it would call."""
    seen = {}
    module = types.ModuleType("open_clip_train.main")

    def main(args):
        train = sys.modules["open_clip_train.train"]
        seen.update(args=args, step=getattr(train, NAME))
        return seen.get("returns")
    module.main = main
    monkeypatch.setitem(sys.modules, "open_clip_train.main", module)
    return seen


def test_module_runner_on_3_3_exits_2_with_one_line(upstream_train, fake_upstream_main, capsys):
    _skip_unless_3_3(upstream_train)
    assert openclip.main(list(ARGS)) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("naflex_accum.openclip: error: open_clip_torch ")
    assert "has no NaFlex training step" in line and "`naflex-accum train`" in line
    assert "args" not in fake_upstream_main  # upstream's main never ran
    assert not hasattr(upstream_train, NAME)


def test_cli_runner_on_3_3_exits_2_with_one_line(upstream_train, capsys):
    _skip_unless_3_3(upstream_train)
    assert cli.main(["openclip", *ARGS]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("naflex-accum openclip: error: ") and "`naflex-accum train`" in line


def test_args_reach_upstream_unchanged_with_our_step_installed(stand_in, upstream_train, fake_upstream_main):
    assert openclip.main(list(ARGS)) == 0
    assert fake_upstream_main["args"] == ARGS
    step = fake_upstream_main["step"]
    assert is_ours(step) and step.__wrapped__ is stand_in
    assert getattr(upstream_train, NAME) is stand_in  # taken out again afterwards


def test_cli_runner_passes_help_through(stand_in, upstream_train, fake_upstream_main):
    assert cli.main(["openclip", "--help"]) == 0
    assert fake_upstream_main["args"] == ["--help"]


@pytest.mark.parametrize("returned,code", [(None, 0), (-1, 1), (1, 1)])
def test_upstream_refusals_become_a_failing_exit(stand_in, upstream_train, fake_upstream_main, returned, code):
    fake_upstream_main["returns"] = returned
    assert openclip.main([]) == code


def test_patch_is_removed_when_upstream_exits(stand_in, upstream_train, monkeypatch):
    # argparse inside upstream's main raises SystemExit (e.g. a bad flag).
    module = types.ModuleType("open_clip_train.main")

    def main(args):
        raise SystemExit(2)
    module.main = main
    monkeypatch.setitem(sys.modules, "open_clip_train.main", module)
    with pytest.raises(SystemExit):
        openclip.main(["--no-such-flag"])
    assert getattr(upstream_train, NAME) is stand_in


def test_mismatched_upstream_is_refused_in_one_line(upstream_train, fake_upstream_main, capsys):
    setattr(upstream_train, NAME, renamed_param_step)
    assert openclip.main(list(ARGS)) == 2
    line = _one_line(capsys.readouterr().err)
    assert "expected open_clip_train.train._train_step_eager(task, batch, accum_state" in line
    assert "(task, batch, state, optimizer" in line and "`naflex-accum train`" in line
    assert "args" not in fake_upstream_main


@pytest.fixture
def upstream_main_with_logging(monkeypatch):
    """A stand-in ``open_clip_train.main`` whose ``main`` calls ``parse_args`` and ``setup_logging``, as upstream's."""
    import argparse
    import logging

    seen = {}
    module = types.ModuleType("open_clip_train.main")
    handler = logging.Handler()
    handler.emit = lambda record: seen.setdefault("records", []).append(record)

    def parse_args(argv):
        return argparse.Namespace(argv=argv)

    def setup_logging(log_file, level):
        logging.root.setLevel(level)
        logging.root.addHandler(handler)

    def main(argv):
        args = module.parse_args(argv)
        module.setup_logging(None, logging.WARNING)
        seen["args"] = vars(args)
    module.parse_args, module.setup_logging, module.main = parse_args, setup_logging, main
    monkeypatch.setitem(sys.modules, "open_clip_train.main", module)
    level = logging.root.level
    yield seen, module, (parse_args, setup_logging)
    logging.root.removeHandler(handler)
    logging.root.setLevel(level)


@pytest.mark.parametrize("mode", ["cached-loss", "replay"])
def test_run_folder_records_the_fix_and_its_mode_at_warning(stand_in, upstream_train, upstream_main_with_logging,
                                                            monkeypatch, mode):
    from naflex_accum import __version__

    seen, module, originals = upstream_main_with_logging
    monkeypatch.setenv("NAFLEX_ACCUM_MODE", mode)
    monkeypatch.setenv("NAFLEX_ACCUM_VERIFY", "0")  # 3.3.0 has no upstream task classes to check with
    assert openclip.main(["--x"]) == 0
    assert seen["args"]["naflex_accum"] == f"{mode} (naflex-accum {__version__})"  # params.txt comes from these
    assert seen["args"]["naflex_accum_verify"] == "skipped (NAFLEX_ACCUM_VERIFY=0)"
    assert "naflex_accum_fingerprint" in seen["args"] and "naflex_accum_upstream" in seen["args"]
    records = [r.getMessage() for r in seen["records"] if r.name == "naflex_accum.openclip"]
    assert len(records) == 3 and f"(accumulation mode {mode}:" in records[0]
    assert records[2].startswith("self-check: skipped (NAFLEX_ACCUM_VERIFY=0)")
    assert (module.parse_args, module.setup_logging) == originals  # put back afterwards


def test_a_step_refusal_inside_upstreams_loop_is_one_line(stand_in, upstream_train, monkeypatch, capsys):
    from naflex_accum.errors import ContractError

    module = types.ModuleType("open_clip_train.main")

    def main(argv):
        raise ContractError("CLIPTask.compute_accum_loss returned a dict; expected a (losses, report) tuple")
    module.main = main
    monkeypatch.setitem(sys.modules, "open_clip_train.main", module)
    assert openclip.main(["--x"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("naflex_accum.openclip: error: the accumulation step stopped the run: CLIPTask.")


@pytest.mark.parametrize("var,value,said", [
    ("NAFLEX_ACCUM_MODE", "fast", ["NAFLEX_ACCUM_MODE=fast: unknown accumulation mode", "cached-loss"]),
    ("NAFLEX_ACCUM_VERIFY", "no", ["NAFLEX_ACCUM_VERIFY=no: use 1 (the default)", "0 to skip"]),
])
def test_a_bad_setting_in_the_environment_is_one_line_before_anything_runs(stand_in, upstream_train,
                                                                           fake_upstream_main, monkeypatch, capsys,
                                                                           var, value, said):
    monkeypatch.setenv(var, value)
    assert openclip.main(list(ARGS)) == 2
    line = _one_line(capsys.readouterr().err)
    assert all(text in line for text in said), line
    assert "args" not in fake_upstream_main and getattr(upstream_train, NAME) is stand_in
