"""Fine-tuning flags of the built-in trainer: --pretrained, --lock-*, --force-patch-dropout, --grad-checkpointing,
--dataset-resampled and --train-data-upsampling-factors."""


import torch
from unit.train.test_finetune import run_argv, shards, weights  # noqa: F401 (fixtures)


def test_two_process_run_with_locks_and_zero_shot(shards, tmp_path):
    """DDP with frozen parameters (not registered for gradient sync), grad checkpointing and rank-0 zero-shot."""
    from integration.test_distributed import run_2proc

    from naflex_accum.models import create_model

    torch.manual_seed(3)
    init = create_model("naflex-tiny").state_dict()
    torch.save(init, tmp_path / "init.pt")
    argv = [a if a != "--logs" else "--logs-dir" for a in run_argv(shards, tmp_path, "ddp")]
    proc = run_2proc(["-m", "naflex_accum.train", *argv,
                      "--naflex-max-tokens-per-batch", "128", "--accum-freq", "2", "--pretrained",
                      str(tmp_path / "init.pt"), "--lock-image", "--lock-text", "--lock-text-unlocked-layers", "1",
                      "--grad-checkpointing", "--zeroshot-data", shards.val, "--zeroshot-classes", "demo-shapes",
                      "--val-seq-len", "16"], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    after = weights(tmp_path / "ddp" / "checkpoints" / "epoch_1.pt")
    assert all(torch.equal(after[k], init[k]) for k in init if k not in ("text_projection", "logit_scale"))
    assert not torch.equal(after["text_projection"], init["text_projection"])
    evals = [line for line in (tmp_path / "ddp" / "out.log").read_text().splitlines() if "Eval Epoch" in line]
    assert sum("shapes-zeroshot-val-top1" in line for line in evals) == 1  # rank 0, after epoch 1
