"""Every bad setting is one line and exit 2, found before the run folder is created or changed."""

import os
import subprocess
import sys

import pytest
from longrun_common import run_argv, train_in_process
from unit.train.test_settings import exit_2_one_line, setup  # noqa: F401 (fixtures)

from naflex_accum.cli import main as cli_main


@pytest.mark.parametrize("yaml_text,needles", [
    ("epochs: 2\naccum-freq: [2\n", ["YAML syntax error at line 3", "p.yaml", "sequence at line 2, column 13"]),
    ("epochs: 2.5\n", ["epochs: argument --epochs: invalid int value: '2.5'"]),
    ("precision: bf16\n", ["--precision bf16", "amp_bf16"]),
    ("precision: pure_fp16\n", ["--precision pure_fp16", "float16"]),
    ("lr-scheduler: linear\n", ["lr-scheduler", "invalid choice: 'linear'"]),
    ("siglip: 1\n", ["siglip: expected true or false"]),
    ("naflex-seq-lens: [16, [32]]\n", ["naflex-seq-lens: expected values"]),
])
def test_bad_presets(setup, tmp_path, capsys, yaml_text, needles):
    shards, model = setup
    (tmp_path / "p.yaml").write_text(yaml_text)
    exit_2_one_line(capsys, run_argv(shards, model, tmp_path / "logs", "run", "--config", str(tmp_path / "p.yaml")),
                    *needles)
    assert not (tmp_path / "logs").exists()

HOLDER = """import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.lockf(fd, fcntl.LOCK_EX)
os.write(fd, b"host test pid %d" % os.getpid())
print("locked", flush=True)
time.sleep(120)
"""


def test_run_folder_held_by_a_live_process(setup, tmp_path, capsys):
    shards, model = setup
    (tmp_path / "held").mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / "held/.lock")], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        exit_2_one_line(capsys, run_argv(shards, model, tmp_path, "held", "--resume", "latest"),
                        "is in use by another live process", f"pid {holder.pid}")
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert sorted(p.name for p in (tmp_path / "held").iterdir()) == [".lock"]


def test_unwritable_logs_folder(setup, tmp_path, capsys):
    shards, model = setup
    (tmp_path / "file").write_text("not a folder")
    exit_2_one_line(capsys, run_argv(shards, model, tmp_path / "file", "run", workers=0),
                    f"cannot write {tmp_path / 'file'}", "Not a directory")
    readonly = tmp_path / "ro"
    readonly.mkdir()
    if os.geteuid() == 0:  # root ignores permission bits: a read-only mount is the real thing
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(readonly)]).returncode:
            pytest.skip("cannot mount a read-only tmpfs here")
    else:
        readonly.chmod(0o555)
    try:
        exit_2_one_line(capsys, run_argv(shards, model, readonly, "run", workers=0),
                        f"cannot write {readonly / 'run'}", "Errno")
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", str(readonly)])


def test_mid_epoch_resume_with_another_shard_list_is_refused(setup, tmp_path, capsys):
    import shutil

    shards, model = setup
    train_in_process(run_argv(shards, model, tmp_path, "a", "--save-every-n-steps", "1", "--keep-last", "4",
                              epochs=1, workers=0))
    step = str(tmp_path / "a/checkpoints/step_3.pt")
    other = shutil.copy(shards.train.replace("{000000..000000}", "000000"), tmp_path / "renamed.tar")
    argv = run_argv(shards, model, tmp_path, "b", "--resume", step)
    argv[argv.index("--train-data") + 1] = str(other)
    exit_2_one_line(capsys, argv, "saved inside epoch 0 with another --train-data (1 shard(s) gone",
                    "resume from an epoch_K.pt")
    assert not (tmp_path / "b").exists()
    epoch = str(tmp_path / "a/checkpoints/epoch_1.pt")  # at an epoch's end nothing of the old list is owed
    argv[argv.index("--resume") + 1] = epoch
    assert cli_main(["train", *argv, "--epochs", "2"]) == 0
