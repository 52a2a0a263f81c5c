"""Upstream's rule for calling ``_train_step_eager``, as the runner reads it from parsed arguments.

``train_one_epoch`` (89fb801 and 5964c41) calls the step when ``--accum-freq`` > 1 or ``main`` made a
GradScaler: for ``--precision amp``, and under FSDP (which upstream drops in a single process) for the fp16
precisions. The runner audits the step only then.
"""
from types import SimpleNamespace

import pytest

from naflex_accum.upstream.preflight import refusal, step_use


def _args(**kw):
    base = dict(accum_freq=1, precision="amp_bf16", fsdp=False)
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize("kw,world,used", [
    (dict(accum_freq=2), None, True),
    (dict(precision="amp"), None, True),
    (dict(), None, False),
    (dict(precision="fp32"), None, False),
    (dict(precision="fp16"), None, False),
    (dict(precision="fp16", fsdp=True), "2", True),
    (dict(precision="fp16", fsdp=True), None, False),  # upstream drops --fsdp in one process
    (dict(precision="amp", fsdp=True), None, True),
    (dict(precision="amp_bf16", fsdp=True), "2", False),
])
def test_the_step_is_used_exactly_when_upstreams_loop_calls_it(monkeypatch, kw, world, used):
    monkeypatch.delenv("SLURM_NTASKS", raising=False)
    if world is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world)
    use = step_use(_args(**kw))
    assert use.used is used, use
    if not used:
        assert use.why.startswith(f"--accum-freq 1 with --precision {kw.get('precision', 'amp_bf16')}: ")


def test_arguments_it_cannot_read_count_as_used_and_are_not_refused():
    assert step_use(SimpleNamespace(argv=["--x"])).used
    assert refusal(SimpleNamespace(argv=["--x"])) is None


def test_train_data_naming_files_that_do_not_exist_is_refused(tmp_path):
    """Red before: upstream's webdataset loader skipped the missing shard forever, after making the run folder."""
    (tmp_path / "a-0.tar").write_bytes(b"")
    present, absent = str(tmp_path / "a-{0..0}.tar"), str(tmp_path / "a-{0..2}.tar")
    assert refusal(_args(train_data=present, dataset_type="webdataset")) is None
    line, own_node = refusal(_args(train_data=f"{present}::{absent}", dataset_type="webdataset"))
    assert line.startswith("--train-data: 2 file(s) not found (first ") and "a-1.tar" in line
    assert own_node  # another node may have them: every rank that lacks them says so
    assert refusal(_args(train_data="pipe:cat /nowhere/x.tar", dataset_type="webdataset")) is None
    assert refusal(_args(train_data=str(tmp_path / "none.csv"), dataset_type="csv"))[0].startswith("--train-data: 1 ")
