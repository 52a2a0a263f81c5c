"""``naflex-accum export`` end to end: a tiny ``naflex-accum train`` run, its checkpoint exported by the console
command, and a fresh process of plain open_clip 3.3.0 and timm that loads both exports after the one documented
step (``naflex_accum.models.register()``), importing the package having registered nothing; a run with several
patch sizes exports a model taking each of them."""
import subprocess
import sys
import textwrap

import pytest
import torch

from longrun_common import SUBPROCESS_ENV, train_in_process
from naflex_accum.data.patches import collate_images, resize_for_seq
from naflex_accum.models import create_model

LOADER = textwrap.dedent("""
    import sys, open_clip, timm, torch
    import naflex_accum, naflex_accum.models
    assert not timm.is_model("naflexvit_tiny_patch16_gap") and "naflex-tiny" not in open_clip.list_models()
    naflex_accum.models.register()  # the one step
    folder, batch_file, out = sys.argv[1:]
    model, _, _ = open_clip.create_model_and_transforms("local-dir:" + folder)
    tower = timm.create_model("local-dir:" + folder + "/timm", pretrained=True)
    batch = torch.load(batch_file)
    with torch.no_grad():
        torch.save({"text": model.eval().encode_text(batch["text"]),
                    **{f"image{p}": model.encode_image(patches) for p, patches in batch["patches"].items()},
                    **{f"trunk{p}": tower.eval()(patches) for p, patches in batch["patches"].items()}}, out)
""")


@pytest.mark.parametrize("sizes", [[16], [8, 16]], ids=["clip", "siglip-8-16"])
def test_a_trained_checkpoint_exported_loads_in_plain_open_clip_and_timm(demo_shards, tmp_path, sizes):
    siglip = len(sizes) > 1
    flags = ["--naflex-patch-sizes", *map(str, sizes)] + (["--siglip"] if siglip else [])
    result = train_in_process(["--train-data", demo_shards, "--model", "naflex-tiny", "--naflex-seq-lens", "16",
                               "--naflex-max-tokens-per-batch", "256", "--train-num-samples", "32", "--epochs", "1",
                               "--workers", "0", "--device", "cpu", "--logs", str(tmp_path), "--name", "run", *flags])
    checkpoint = tmp_path / "run" / "checkpoints" / "epoch_1.pt"
    assert result["exit_code"] == 0 and checkpoint.is_file()
    cmd = [sys.executable, "-m", "naflex_accum.cli", "export", str(checkpoint), str(tmp_path / "out")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=SUBPROCESS_ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]  # (a second export into it: tests/unit/test_export.py)

    g = torch.Generator().manual_seed(0)
    images = [torch.randint(0, 256, (3, 48, 64), dtype=torch.uint8, generator=g) for _ in range(3)]
    # the trainer's patch dicts: one size flattened; with several, each size unflattened
    batch = {"patches": {p: collate_images([resize_for_seq(image, 16, p) for image in images], seq_len=16,
                                           patch_size=p, flatten=not siglip) for p in sizes},
             "text": torch.randint(1, 49407, (3, 32), generator=g)}
    torch.save(batch, tmp_path / "batch.pt")
    (tmp_path / "load.py").write_text(LOADER)
    proc = subprocess.run([sys.executable, str(tmp_path / "load.py"), str(tmp_path / "out"), str(tmp_path / "batch.pt"),
                           str(tmp_path / "features.pt")], capture_output=True, text=True, env=SUBPROCESS_ENV,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(tmp_path / "features.pt")

    model = create_model("naflex-tiny", siglip=siglip, patch_sizes=sizes).eval()  # as the trainer built it
    model.load_state_dict(torch.load(checkpoint, weights_only=True)["state_dict"])
    with torch.no_grad():
        want = {"text": model.encode_text(batch["text"]),
                **{f"image{p}": model.encode_image(patches) for p, patches in batch["patches"].items()},
                **{f"trunk{p}": model.visual.trunk(patches) for p, patches in batch["patches"].items()}}
    assert got.keys() == want.keys()
    for key in want:
        assert torch.allclose(got[key], want[key], atol=1e-5, rtol=1e-5), key
