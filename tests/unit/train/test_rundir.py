"""train.kept.rundir: a run folder is claimed, created and (after a refused start) removed by its own rules;
params.txt is never overwritten; stale temporary files go; --resume latest never restarts an abandoned run."""
import argparse

import pytest
import torch

from naflex_accum.errors import UsageError
from naflex_accum.train.ending.distributed import World
from naflex_accum.train.output.logs import setup_logging
from naflex_accum.train.kept.rundir import RunPaths, claim_run, create_run_folder, default_name


@pytest.fixture(autouse=True)
def _quiet_logging():
    yield
    setup_logging(None, True)  # out.log closed: the run's handler is not left on the logger


def _args(tmp_path, **kw):
    base = dict(logs=str(tmp_path / "logs"), name="run", resume=None, model="ViT-B/16", lr=1e-3, batch_size=4,
                workers=0, precision="fp32")
    base.update(kw)
    return argparse.Namespace(**base)


def _start(args):
    claim = claim_run(args, World())
    create_run_folder(claim, args, World())
    return claim


def _checkpoint(path, epoch, step):
    torch.save({"epoch": epoch, "global_step": step, "state_dict": {}, "optimizer": {}}, path)


def test_paths_are_open_clips_layout(tmp_path):
    paths = RunPaths(tmp_path)
    assert paths.checkpoint(3) == tmp_path / "checkpoints/epoch_3.pt"
    assert paths.step_checkpoint(40) == tmp_path / "checkpoints/step_40.pt"
    assert paths.most_recent == tmp_path / "checkpoints/epoch_latest.pt"
    assert paths.results == tmp_path / "checkpoints/results.jsonl" and paths.log_file == tmp_path / "out.log"
    name = default_name(_args(tmp_path))
    assert name.endswith("-model_ViT-B-16-lr_0.001-b_4-j_0-p_fp32") and "/" not in name


def test_a_fresh_start_makes_the_folder_and_a_second_one_is_refused(tmp_path):
    args = _args(tmp_path)
    claim = _start(args)
    root = tmp_path / "logs/run"
    assert claim.created == tmp_path / "logs" and claim.resume is None
    assert (root / "checkpoints").is_dir() and (root / ".lock").is_file()
    assert "name: run" in (root / "params.txt").read_text()
    claim.release()
    with pytest.raises(UsageError, match=r"run folder .*logs/run already exists; pass --resume latest"):
        claim_run(_args(tmp_path), World())


def test_a_resume_keeps_params_txt_and_writes_a_new_file_each_time(tmp_path):
    _start(_args(tmp_path)).release()
    root = tmp_path / "logs/run"
    _checkpoint(root / "checkpoints/epoch_1.pt", 1, 4)
    before = (root / "params.txt").read_text()
    for expected in ("params-resume-epoch_1.txt", "params-resume-epoch_1-2.txt"):
        claim = _start(_args(tmp_path, resume="latest", lr=0.5))
        assert claim.resume == root / "checkpoints/epoch_1.pt" and "lr: 0.5" in (root / expected).read_text()
        claim.release()
    assert (root / "params.txt").read_text() == before


def test_stale_temporaries_go_and_abandoned_only_is_refused(tmp_path):
    _start(_args(tmp_path)).release()
    ckpts = tmp_path / "logs/run/checkpoints"
    (ckpts / ".step_4.pt.tmp-123").write_bytes(b"half")
    (ckpts / "abandoned-1").mkdir()
    _checkpoint(ckpts / "abandoned-1/epoch_2.pt", 2, 8)
    with pytest.raises(UsageError, match=r"--resume latest: .* holds no loadable checkpoint of the current branch, "
                                         r"only abandoned ones \(in abandoned-1/\)"):
        claim_run(_args(tmp_path, resume="latest"), World())
    assert not (ckpts / ".step_4.pt.tmp-123").exists()


def test_a_refused_start_removes_only_what_it_made_and_saved_nothing_in(tmp_path):
    (tmp_path / "there").mkdir()  # empty, but not this start's
    args = _args(tmp_path, logs=str(tmp_path / "there/a/b"))
    claim = _start(args)
    claim.discard()
    assert not (tmp_path / "there/a").exists() and (tmp_path / "there").is_dir()  # the parents it made go too
    claim = _start(args)
    _checkpoint(tmp_path / "there/a/b/run/checkpoints/epoch_1.pt", 1, 1)
    claim.discard()
    assert (tmp_path / "there/a/b/run/checkpoints/epoch_1.pt").exists()
    claim.release()


def test_a_file_where_the_folder_would_be_is_one_line(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs/run").write_text("")
    with pytest.raises(UsageError, match=r"--logs-dir .* --name run: .*run is a file, not a folder"):
        claim_run(_args(tmp_path, resume="latest"), World())
