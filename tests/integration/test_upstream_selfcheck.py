"""The runner's self-check on the pinned upstream: it stops a run whose installed step fails, on any rank.

``upstream_jobs/broken_step.py`` runs ``naflex_accum.openclip`` with a reference
bug in place of the fixed step on the ranks named in $BROKEN_RANKS. The check
must stop every rank with exit 2 and one line naming the failing row and its
rank, before upstream creates the run folder; with nothing broken, every rank
agrees and the run folder records it. The two-rank runs use torchrun with gloo
on the CPU.
"""
import json
import subprocess
import sys

import pytest
from upstream_real import DETERMINISTIC, JOBS, last_json, run_python, tail, upstream_env

ERROR = "naflex_accum.openclip: error: the fixed step failed its check on this run's task before training ("
TIMEOUT = 300


def _args(demo_shards, model):
    return ["--use-naflex", "--model", model, "--train-data", demo_shards, "--dataset-type", "webdataset",
            "--train-num-samples", "40", "--batch-size", "8", "--naflex-seq-lens", "16", "64",
            "--naflex-max-tokens-per-batch", "256", "--accum-freq", "2", "--naflex-loss-scale", "linear",
            "--epochs", "1", "--workers", "0", "--lr", "1e-3", "--warmup", "0", "--device", "cpu", "--name", "run"]


@pytest.fixture
def model(tmp_path):
    from naflex_accum.upstream.tiny_tasks import write_model_dir

    return write_model_dir(str(tmp_path / "tiny-clip"), "clip")


def _errors(proc):
    return [line for line in proc.stderr.splitlines() if line.startswith(ERROR)]


@pytest.mark.parametrize("bug,row", [
    ("per-replay-scale", "clip linear [1, 2] without stochastic layers: tower gradient relative error 1.01e+00 "
                         "(tolerance 1e-05)"),
    ("logit-k-times", "logit_scale gradient ratio 2.000000 (must be 1)"),
    ("no-rng-replay", "clip linear [1, 2] with stochastic layers: tower gradient relative error"),
])
def test_a_failing_row_stops_the_run_in_one_line_before_the_run_folder(upstream_src, demo_shards, model, tmp_path,
                                                                      bug, row):
    proc = run_python(upstream_src, [JOBS / "broken_step.py", *_args(demo_shards, model)], cwd=tmp_path,
                      env=upstream_env(upstream_src, BROKEN_RANKS="0", BUG=bug, **DETERMINISTIC))
    assert proc.returncode == 2, tail(proc)
    assert "Traceback" not in proc.stderr
    errors = _errors(proc)
    assert len(errors) == 1 and errors[0] == proc.stderr.strip().splitlines()[-1], tail(proc)
    assert "(rank 0: " in errors[0] and row in errors[0]
    assert errors[0].endswith("NAFLEX_ACCUM_VERIFY=0 skips the check.")
    assert not (tmp_path / "logs").exists()


def _torchrun(src, demo_shards, model, cwd, **env):
    # torchrun takes --logs as its own flag anywhere on the line: upstream writes ./logs under cwd
    return run_python(src, ["-m", "torch.distributed.run", "--nproc-per-node", "2", JOBS / "broken_step.py",
                            *_args(demo_shards, model)], cwd=cwd, timeout=TIMEOUT,
                      env=upstream_env(src, **DETERMINISTIC, **env))


def _two_ranks(src, demo_shards, model, cwd, **env):
    """Two ranks started by hand with torchrun's variables, each with its own stderr (torchrun would end the
    second once the first exits, and mix their output)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, JOBS / "broken_step.py", *_args(demo_shards, model)], cwd=cwd,
                              env=upstream_env(src, **DETERMINISTIC, **env, RANK=str(rank), LOCAL_RANK=str(rank),
                                               WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    try:
        return [(p.wait(timeout=TIMEOUT), p.stderr.read()) for p in procs]
    finally:
        for p in procs:
            p.kill()


def test_one_failing_rank_stops_every_rank(upstream_src, demo_shards, model, tmp_path):
    for rank, (code, err) in enumerate(_two_ranks(upstream_src, demo_shards, model, tmp_path, BROKEN_RANKS="1")):
        errors = [line for line in err.splitlines() if line.startswith(ERROR)]
        assert code == 2 and "Traceback" not in err, (rank, err[-3000:])
        assert len(errors) == 1 and "(rank 1: 8 of 8 rows failed; the first: clip linear [1, 2]" in errors[0]
    assert not (tmp_path / "logs").exists()


@pytest.mark.skipif(sys.platform == "darwin", reason="torchrun with gloo on Linux CI")
def test_every_rank_agrees_and_the_run_folder_says_so(upstream_src, demo_shards, model, tmp_path):
    # Upstream's main stops at its DDP wrap, before its first step: a folder it made would go, one there stays.
    (tmp_path / "logs" / "run").mkdir(parents=True)
    proc = _torchrun(upstream_src, demo_shards, model, tmp_path)
    params = (tmp_path / "logs" / "run" / "params.txt").read_text()
    assert ("naflex_accum_verify: PASS 8/8 rows (CLIPTask, --naflex-loss-scale linear, accumulation mode "
            "cached-loss, tiny CPU model) on all 2 ranks") in params, tail(proc)
    assert not _errors(proc)
    # Upstream's own main then cannot wrap a CPU model in DDP (it passes device_ids=[cpu]): its limit, not ours.
    assert proc.returncode == 0 or "DistributedDataParallel device_ids and output_device arguments" in proc.stderr


UNVERIFIABLE = r"""
import json, sys
import naflex_accum
from naflex_accum.upstream import selfcheck
from naflex_accum.upstream.patch import original_step
from open_clip_train.params import parse_args

naflex_accum.install()
said = []
for argv in json.loads(sys.argv[1]):
    args = parse_args(argv)
    args.rank, args.world_size, args.distributed = 0, 1, False
    outcome = selfcheck.run(args, original_step())
    said.append([outcome.passed, outcome.error])
print(json.dumps(said))
"""


def test_tasks_the_check_cannot_stand_in_for_are_named(upstream_src, tmp_path):
    cases = [["--model", "naflexgenlip_test"], ["--accum-freq", "2", "--distill-model", "ViT-B-32",
                                                "--distill-pretrained", "x"],
             ["--accum-freq", "2", "--model", "naflexclap_test"]]
    said = last_json(run_python(upstream_src, ["-c", UNVERIFIABLE, json.dumps(cases)], cwd=tmp_path))
    assert said == [
        [False, "--model naflexgenlip_test trains GenLipTask, which naflex-accum does not verify"],
        [False, "--distill-model trains DistillCLIPTask, which naflex-accum does not verify"],
        [False, "--model naflexclap_test is an audio-text (CLAP) model, which naflex-accum does not verify"]]
