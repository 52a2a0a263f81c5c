"""The runner refuses, in one line and before upstream's ``main`` creates anything, what upstream would crash on.

``python -m naflex_accum.openclip`` on each pinned upstream commit: every
refused setting must exit 2 with exactly one line on stderr naming the flag,
no traceback, no run folder under ``--logs`` and no self-check record. Each
commit's refusals (``CASES``) run in one process, ``upstream_jobs/runner_cases.py``
(the runner's ``main`` per case, its stdout and stderr caught as its own
process's would be): one torch and open_clip import instead of one a case. Two
ranks, started as torchrun starts them, take a refusal's whole path through
``python -m``. Some runs train: distillation at ``--accum-freq 1`` (upstream
never calls the fixed step: the record says so instead of auditing it), and the tower locks that
upstream takes, each after its refusal (a run's status lines, once each on
stderr and in out.log: test_upstream_trainer.py). ``--help`` names the
runner and its variables.
"""
import json
import socket
import subprocess
import sys

import pytest
from upstream_real import DETERMINISTIC, JOBS, PINNED, _src, last_json, run_python, tail, upstream_env

from naflex_accum.upstream.tiny_tasks import model_config

PREFIX = "naflex_accum.openclip: error: "
TIMEOUT = 300
RUNNER, CLI = "naflex_accum.openclip", "naflex_accum.cli"
DATA = object()  # in a case's argv: the demo shards, then --logs (the case's own) --name run
OTHERS = [  # on 89fb801
    (["--distill-model", "ViT-B-32"], "--distill-model without --distill-pretrained"),
    (["--model", "coca_ViT-B-32", "--distill-model", "ViT-B-32", "--distill-pretrained", "x"],
     "--distill-model with --model coca_ViT-B-32"),
    (["--use-naflex", "--naflex-seq-lens", "0", "64"], "--naflex-seq-lens 0 64: "),
    (["--torchcompile", "--torchcompile-strategy", "step", "--accum-freq", "2"],
     "--torchcompile-strategy step with --accum-freq 2"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
]
# name -> (module, argv, env); {model} {weights} {coca} {resnet}: the models of the fixture ``refused``
CASES = {
    "accum -1": (RUNNER, ["--accum-freq", "-1", "--precision", "fp32", DATA], {}),
    "accum 0": (RUNNER, ["--accum-freq", "0", DATA], {}),
    "distill accum 2": (RUNNER, ["--model", "{model}", "--distill-model", "{model}", "--distill-pretrained",
                                 "{weights}", "--accum-freq", "2", DATA], {"NAFLEX_ACCUM_VERIFY": "0"}),
    "no arguments": (RUNNER, [], {}),
    "batch 0": (RUNNER, ["--use-naflex", "--batch-size", "0", "--naflex-loss-scale", "linear", "--accum-freq", "2",
                         DATA], {}),
    f"help {RUNNER}": (RUNNER, ["--help"], {}),
    f"help {CLI}": (CLI, ["openclip", "--help"], {}),
    "lock text": (RUNNER, ["--model", "{model}", "--accum-freq", "2", "--lock-text", DATA], {}),
    "coca text": (RUNNER, ["--model", "{coca}", "--lock-text", "--lock-text-freeze-layer-norm", DATA], {}),
    "coca image": (RUNNER, ["--model", "{coca}", "--lock-image", DATA], {}),
    "resnet": (RUNNER, ["--model", "{resnet}", "--lock-image", "--lock-image-unlocked-groups", "1", DATA], {}),
    **{f"other {i}": (RUNNER, [*args, DATA], {}) for i, (args, _) in enumerate(OTHERS)},
    "genlip": (RUNNER, ["--model", "naflexgenlip_test", "--accum-freq", "2", DATA], {}),
    "rank 1 bad flag": (RUNNER, ["--no-such-flag", DATA], {"RANK": "1", "WORLD_SIZE": "2"}),
    "rank 1 upstream check": (RUNNER, ["--model", "naflexgenlip_test", "--accum-freq", "2", DATA],
                              {"RANK": "1", "WORLD_SIZE": "2"}),
    "rank 1 own files": (RUNNER, [DATA, "--train-data", "/no/such/shard-000000.tar"], {"RANK": "1", "WORLD_SIZE": "2"}),
    "a stray RANK": (RUNNER, ["--no-such-flag", DATA], {"RANK": "1", "WORLD_SIZE": None}),
}
ONLY_ON = {"resnet": "5964c41", "genlip": "89fb801",
           **{name: "89fb801" for name in CASES if name.startswith(("rank 1", "a stray"))},
           **{f"other {i}": "89fb801" for i in range(len(OTHERS))}}
TINY_RESNET = {"embed_dim": 32, "vision_cfg": {"image_size": 32, "layers": [1, 1, 1, 1], "width": 8},
               "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1}}


@pytest.fixture(scope="module")
def tiny_clip(upstream_src, tmp_path_factory):
    """A tiny CLIP model folder with saved weights (the teacher of the distillation run too), built by upstream."""
    folder = tmp_path_factory.mktemp("tiny-clip")
    code = "import sys; from naflex_accum.upstream.tiny_tasks import write_model_dir as w; w(sys.argv[1], 'clip', " \
           "weights=True)"
    proc = run_python(upstream_src, ["-c", code, folder], cwd=folder)
    assert proc.returncode == 0, tail(proc)
    return f"local-dir:{folder}", folder / "open_clip_pytorch_model.bin"


def _data(demo_shards):
    return ["--train-data", demo_shards, "--dataset-type", "webdataset", "--train-num-samples", "8", "--workers", "0",
            "--device", "cpu"]


def _runner(src, args, cwd, module=RUNNER, **env):
    env = {"NAFLEX_ACCUM_MODE": None, "NAFLEX_ACCUM_VERIFY": None, **DETERMINISTIC, **env}
    return run_python(src, ["-m", module, *args], cwd=cwd, timeout=TIMEOUT, env=upstream_env(src, **env))


def _model_dir(folder, config: dict) -> str:
    """A ``local-dir:`` model of open_clip config ``config``, without weights."""
    folder.mkdir()
    (folder / "open_clip_config.json").write_text(json.dumps({"model_cfg": config}))
    return f"local-dir:{folder}"


@pytest.fixture(scope="module")
def refused(demo_shards, tiny_clip, tmp_path_factory):
    """``(commit, case name) -> (its run as a CompletedProcess, its --logs)``: ``CASES`` on each pinned commit."""
    folder = tmp_path_factory.mktemp("refusals")
    models = {"model": tiny_clip[0], "weights": str(tiny_clip[1]), "resnet": _model_dir(folder / "resnet", TINY_RESNET),
              "coca": _model_dir(folder / "coca", model_config("coca"))}
    done = {}
    for commit in PINNED:
        cases = []
        for name, (module, argv, env) in CASES.items():
            if ONLY_ON.get(name, commit) != commit:
                continue
            cwd = folder / commit / name.replace(" ", "-")
            cwd.mkdir(parents=True)
            flags = [*_data(demo_shards), "--logs", str(cwd / "logs"), "--name", "run"]
            argv = [part for arg in argv for part in (flags if arg is DATA else [arg.format(**models)])]
            cases.append((name, {"module": module, "argv": argv, "cwd": str(cwd),
                                 "env": {"NAFLEX_ACCUM_MODE": None, "NAFLEX_ACCUM_VERIFY": None, **env}}))
        (folder / f"{commit}.json").write_text(json.dumps([case for _, case in cases]))
        src = _src(tmp_path_factory, commit)
        proc = run_python(src, [JOBS / "runner_cases.py", folder / f"{commit}.json"], cwd=folder, timeout=TIMEOUT,
                          env=upstream_env(src, NAFLEX_ACCUM_MODE=None, NAFLEX_ACCUM_VERIFY=None, **DETERMINISTIC))
        for (name, case), out in zip(cases, last_json(proc), strict=True):
            run = subprocess.CompletedProcess(case["argv"], out["code"], out["stdout"], out["stderr"])
            done[commit, name] = run, folder / commit / name.replace(" ", "-") / "logs"
    return done


def _refused(proc, logs, *said) -> str:
    """The one line of a refused run: exit 2, nothing else on stderr, no traceback, no run folder."""
    assert proc.returncode == 2, tail(proc)
    assert "Traceback" not in proc.stderr + proc.stdout, tail(proc)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(PREFIX), proc.stderr[-3000:]
    assert all(text in lines[0] for text in said), lines[0]
    assert "PASS" not in proc.stderr + proc.stdout
    assert not logs.exists(), sorted(logs.rglob("*"))
    return lines[0]


def _refuse(refused, commit, name, *said) -> str:
    return _refused(*refused[commit, name], *said)


def test_a_negative_accum_freq_is_refused(pinned, refused):
    _refuse(refused, pinned.commit, "accum -1", "--accum-freq -1: use 1 ", "or more")


def test_accum_freq_zero_is_refused(pinned, refused):
    _refuse(refused, pinned.commit, "accum 0", "--accum-freq 0: use 1 ")


def test_ddp_on_the_cpu_is_refused_by_rank_0_and_every_rank_exits_2(pinned, demo_shards, tmp_path):
    """Two ranks as torchrun starts them (its variables), each with its own stderr."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    logs = tmp_path / "logs"
    argv = [sys.executable, "-m", "naflex_accum.openclip", "--accum-freq", "2", *_data(demo_shards), "--logs", logs,
            "--name", "run"]
    procs = [subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=upstream_env(pinned.src, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                                               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **DETERMINISTIC))
             for rank in (0, 1)]
    try:
        done = [subprocess.CompletedProcess(p.args, *((p.wait(timeout=TIMEOUT),) + p.communicate()))
                for p in procs]
    finally:
        for p in procs:
            p.kill()
    _refused(done[0], logs, "--device cpu with WORLD_SIZE=2: upstream's main cannot train DDP on the CPU",
             "`naflex-accum train`")
    assert done[1].returncode == 2 and done[1].stderr.strip() == "", tail(done[1])  # rank 0 says it


def test_distillation_with_accumulation_is_refused_even_unverified(pinned, refused):
    _refuse(refused, pinned.commit, "distill accum 2",
            "--distill-model with --accum-freq 2: upstream's distillation trains only at --accum-freq 1")


def test_distillation_without_accumulation_trains_and_records_that_the_step_is_unused(pinned, demo_shards,
                                                                                      tiny_clip, tmp_path):
    model, weights = tiny_clip
    logs = tmp_path / "logs"
    proc = _runner(pinned.src, ["--model", model, "--distill-model", model, "--distill-pretrained", weights,
                                "--batch-size", "4", "--epochs", "1", "--lr", "1e-3", "--warmup", "0",
                                *_data(demo_shards), "--logs", logs, "--name", "distill"], tmp_path)
    assert proc.returncode == 0, tail(proc)
    why = ("not run: this run never calls the fixed step (--accum-freq 1 with --precision amp_bf16: upstream trains "
           "each batch with its own one-batch step")
    params = (logs / "distill" / "params.txt").read_text()
    assert f"naflex_accum_verify: {why}" in params
    said = [line for line in proc.stderr.splitlines() if "self-check:" in line and "naflex_accum_verify" not in line]
    assert len(said) == 1 and said[0].startswith(f"naflex-accum: self-check: {why}"), said
    assert "Distill_loss" in (logs / "distill" / "out.log").read_text()


def test_no_arguments_at_all_is_refused(pinned, refused):
    _refuse(refused, pinned.commit, "no arguments", "no --train-data: ", "--dataset-type synthetic")


def test_a_zero_reference_batch_size_is_refused_before_the_run_folder(pinned, refused):
    _refuse(refused, pinned.commit, "batch 0", "--batch-size 0: use 1 or more")


@pytest.mark.parametrize("module,prog", [(RUNNER, f"python -m {RUNNER}"), (CLI, "naflex-accum openclip")])
def test_help_names_the_runner_its_variables_and_upstreams_flags(pinned, refused, module, prog):
    proc, logs = refused[pinned.commit, f"help {module}"]
    assert proc.returncode == 0 and proc.stderr == "", tail(proc)
    assert proc.stdout.startswith(f"usage: {prog} [-h] "), proc.stdout[:300]
    for text in ("--accum-freq", "--naflex-loss-scale", pinned.tokens_flag, "NAFLEX_ACCUM_MODE=cached-loss|replay",
                 "NAFLEX_ACCUM_VERIFY=1|0", f"{prog}: upstream open_clip main's trainer"):
        assert text in proc.stdout, text
    assert not logs.exists()


@pytest.mark.parametrize("args,said", OTHERS, ids=lambda v: v if isinstance(v, str) else None)
def test_other_settings_upstream_would_crash_on_are_refused(refused, args, said):
    _refuse(refused, "89fb801", f"other {OTHERS.index((args, said))}", said)


def test_upstreams_own_checks_after_parsing_are_one_line(refused):
    _refuse(refused, "89fb801", "genlip", "GenLIP does not support --accum-freq > 1")


def test_a_bad_flag_under_a_launcher_is_said_by_rank_0_alone(refused):
    """Every rank reads the same flags: rank 0 says the one line (above), the others exit 2 without a word."""
    for name in ("rank 1 bad flag", "rank 1 upstream check"):
        proc, logs = refused["89fb801", name]
        assert (proc.returncode, proc.stderr, proc.stdout) == (2, "", ""), tail(proc)
        assert not logs.exists()


def test_a_rank_whose_node_lacks_the_data_says_so_and_one_process_always_speaks(refused):
    """Files are each node's own: rank 1 names itself; with a stray RANK but no world size there is no rank 0."""
    _refuse(refused, "89fb801", "rank 1 own files", "rank 1: --train-data: 1 file(s) not found")
    _refuse(refused, "89fb801", "a stray RANK", "unrecognized arguments: --no-such-flag")


def _trains(pinned, demo_shards, tmp_path, model, *args):
    logs = tmp_path / "logs"
    proc = _runner(pinned.src, ["--model", model, "--batch-size", "4", "--accum-freq", "2", "--epochs", "1", "--lr",
                                "1e-3", "--warmup", "0", *args, *_data(demo_shards), "--logs", logs, "--name", "run"],
                   tmp_path)
    assert proc.returncode == 0, tail(proc)
    return (logs / "run" / "params.txt").read_text()


def test_lock_text_without_freezing_layer_norm_is_refused_and_the_retry_with_it_trains(pinned, refused,
                                                                                      demo_shards, tiny_clip,
                                                                                      tmp_path):
    model, _ = tiny_clip
    _refuse(refused, pinned.commit, "lock text",
            f"--lock-text without --lock-text-freeze-layer-norm: the text tower of --model {model}",
            "add --lock-text-freeze-layer-norm")
    params = _trains(pinned, demo_shards, tmp_path, model, "--lock-text", "--lock-text-freeze-layer-norm",
                     "--lock-image")
    assert "lock_text: True" in params and "lock_image: True" in params


@pytest.mark.parametrize("case,said", [
    ("coca text", "--lock-text with --model {}: upstream builds a CoCa from it, which has no text tower to lock"),
    ("coca image", "--lock-image with --model {}: upstream builds a CoCa from it, which has no image tower"),
], ids=["text", "image"])
def test_locking_a_tower_coca_does_not_lock_is_refused(pinned, refused, case, said):
    proc, logs = refused[pinned.commit, case]
    _refused(proc, logs, said.format(proc.args[proc.args.index("--model") + 1]), "drop --lock-")


def test_a_partly_unlocked_resnet_is_refused_only_where_upstream_asserts(pinned, refused, demo_shards, tmp_path):
    """5964c41's ModifiedResNet.lock asserts --lock-image-unlocked-groups 0; 89fb801's locks by layer groups."""
    if pinned.commit == "5964c41":
        _refuse(refused, pinned.commit, "resnet", "--lock-image-unlocked-groups 1 with --model",
                "use --lock-image-unlocked-groups 0")
    else:
        model = _model_dir(tmp_path / "tiny-resnet", TINY_RESNET)
        lock = ["--lock-image", "--lock-image-unlocked-groups", "1"]
        assert "lock_image_unlocked_groups: 1" in _trains(pinned, demo_shards, tmp_path, model, *lock)
