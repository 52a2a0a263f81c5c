"""``naflex-accum export CHECKPOINT DIR``: a trained model as open_clip and timm load it.

Invariant: DIR gets an open_clip ``local-dir:`` model and, for a timm tower, that tower in timm's folder format,
from the checkpoint's weights loaded strictly first (DDP, FSDP and compiled keys made plain); it is built in a
hidden sibling and renamed, so a failed export leaves nothing, and a non-empty DIR is refused. Every bad input
is one line, exit 2. docs/training.md, "Exporting a model: ``naflex-accum export``".
"""
import ast
import json
import os
import shutil
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
from open_clip.timm_model import TimmModel
from safetensors.torch import save_file
from timm.models import clean_state_dict, save_for_hf

from ..data.patches import IMAGE_MEAN, IMAGE_STD
from ..errors import OneLineParser, UsageError, WriteError, first_line
from ..models import create_model, list_models, model_config
from ..train.kept.checkpoint import load_checkpoint
from ..train.kept.resume import check_fits

CONFIG_NAME = "open_clip_config.json"  # what open_clip's local-dir: reads
WEIGHTS_NAME = "open_clip_model.safetensors"  # the first name open_clip's local-dir: looks for
TIMM_FOLDER = "timm"
# The trainer's image statistics and resampling (data.patches), for open_clip's and timm's transforms.
PREPROCESS = {"mean": list(IMAGE_MEAN), "std": list(IMAGE_STD), "interpolation": "bicubic"}
LOADING = """\
  import naflex_accum.models; naflex_accum.models.register()   # the one step first
  open_clip.create_model_and_transforms('local-dir:{dir}')
  timm.create_model('local-dir:{dir}/timm', pretrained=True)"""


def main(argv, prog="naflex-accum export", ends_process=False) -> int:
    parser = OneLineParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", metavar="CHECKPOINT", help="a training checkpoint (checkpoints/epoch_K.pt, ...)")
    parser.add_argument("dir", metavar="DIR", help="output folder: new, or empty")
    parser.add_argument("--model", default=None, help="the model's config name or JSON path (default: the run "
                        "folder's params.txt)")
    args = parser.parse_args(argv)
    written = export(args.checkpoint, args.dir, args.model)
    print(f"wrote {args.dir}: {', '.join(written)}")
    print(LOADING.format(dir=args.dir))
    return 0


def export(checkpoint, folder, model_name: Optional[str] = None) -> List[str]:
    """Write ``checkpoint``'s model into ``folder`` (see the module); returns the files written, relative."""
    check_destination(Path(folder))
    payload = load_checkpoint(checkpoint, flag="CHECKPOINT")
    params, entries = run_params(Path(checkpoint))
    source = "--model"
    if model_name is None:
        if params is None:
            raise UsageError(f"CHECKPOINT {checkpoint}: no run folder's params.txt above it names the model; pass "
                             f"--model ({', '.join(list_models())}, or a JSON config)")
        source, model_name = params, entries["model"]
    sizes = trained_patch_sizes(payload, f"CHECKPOINT {checkpoint}", params, entries)
    weights = payload["state_dict"]
    if not isinstance(weights, dict) or not weights or not all(torch.is_tensor(v) for v in weights.values()):
        raise UsageError(f"CHECKPOINT {checkpoint}: its state_dict holds no tensors")
    state_dict = clean_state_dict(weights)
    try:
        cfg = model_config(model_name, siglip="logit_bias" in state_dict)
    except ValueError as exc:
        raise UsageError(f"{exc}" if source == "--model" else f"{source} names model {model_name!r}, which is not a "
                         f"model config here; pass --model ({', '.join(list_models())}, or a JSON config)") from None
    try:
        cfg = model_config(cfg, patch_sizes=sizes)
    except ValueError as exc:
        raise UsageError(f"CHECKPOINT {checkpoint}: {exc}") from None
    try:
        model = create_model(cfg)
    except (TypeError, KeyError, RuntimeError) as exc:  # keys CLIP does not take, a tower timm does not know
        raise UsageError(f"model {model_name!r}: open_clip cannot build it ({first_line(exc, named=True)})") from None
    # the prefixes DDP and torch.compile add go (timm's clean_state_dict), 1-dim logit parameters (FSDP) fit
    model.load_state_dict(check_fits(model, state_dict, f"CHECKPOINT {checkpoint}", model_name))
    return write(model.eval(), cfg, Path(folder), sizes)


def check_destination(folder: Path) -> None:
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"DIR {folder}: exists and is not a folder; choose a new DIR")
    if folder.is_dir() and any(folder.iterdir()):
        raise UsageError(f"DIR {folder}: exists and is not empty; choose a new or empty DIR (nothing is "
                         f"overwritten)")


def run_params(checkpoint: Path) -> Tuple[Optional[str], Dict[str, str]]:
    """``(path, {name: value})`` of the ``params.txt`` naming the model in the run folder above ``checkpoint``
    (``checkpoints/``, or a branch's ``checkpoints/abandoned-N/``); ``(None, {})`` where there is none."""
    for folder in list(checkpoint.resolve().parents)[:3]:
        params = folder / "params.txt"
        if params.is_file():
            lines = (line.partition(": ") for line in params.read_text(errors="replace").splitlines())
            entries = {name: value.strip() for name, colon, value in lines if colon}
            if "model" in entries:
                return str(params), entries
    return None, {}


def trained_patch_sizes(payload: dict, name: str, params: Optional[str],
                        entries: Dict[str, str]) -> Optional[List[int]]:
    """The ``--naflex-patch-sizes`` the checkpoint was trained with: its own record, else its schedule, else the
    run's params.txt; None where none records them (the model's own size)."""
    schedule = payload.get("schedule")
    if "naflex_patch_sizes" in payload:
        where, sizes = name, payload["naflex_patch_sizes"]
    elif isinstance(schedule, dict) and "naflex_patch_sizes" in schedule:
        where, sizes = f"{name}: its schedule", schedule["naflex_patch_sizes"]
    elif "naflex_patch_sizes" in entries:
        where, sizes = params, entries["naflex_patch_sizes"]
        try:
            sizes = ast.literal_eval(sizes)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            pass  # refused below, by the text
    else:
        return None
    if sizes is None:  # upstream open_clip's params.txt when its --naflex-patch-sizes was left out
        return None
    # type() and not isinstance(): True is no patch size
    if not (isinstance(sizes, (list, tuple)) and sizes and all(type(size) is int and size > 0 for size in sizes)):
        raise UsageError(f"{where}: naflex_patch_sizes {sizes!r} is not a list of patch sizes (integers >= 1, as "
                         f"--naflex-patch-sizes takes)")
    return list(sizes)


def write(model, cfg: dict, folder: Path, sizes: Optional[List[int]] = None) -> List[str]:
    """The export, made in a hidden folder beside ``folder``, then renamed to it or, into an existing empty one,
    its entries moved in (that folder stays: it may be someone's working directory)."""
    target = Path(os.path.abspath(folder))
    staging = target.parent / f".{target.name}.export-{os.getpid()}"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        write_files(model, cfg, staging, sizes)
        written = sorted(p.relative_to(staging).as_posix() for p in staging.rglob("*") if p.is_file())
        if target.is_dir():
            for entry in sorted(staging.iterdir()):
                os.rename(entry, target / entry.name)
            staging.rmdir()
        else:
            os.rename(staging, target)
    except BaseException as exc:  # an OS error, or Ctrl-C: nothing is left either way
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(exc, OSError):
            raise WriteError(exc.filename or folder, exc) from None
        raise
    return written


def write_files(model, cfg: dict, folder: Path, sizes: Optional[List[int]]) -> None:
    # the sizes beside model_cfg: open_clip builds CLIP from every model_cfg key and refuses unknown ones
    record = {"naflex_patch_sizes": sizes} if sizes else {}
    (folder / CONFIG_NAME).write_text(json.dumps({"model_cfg": cfg, "preprocess_cfg": PREPROCESS, **record}, indent=2))
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(folder / WEIGHTS_NAME))
    if isinstance(model.visual, TimmModel):
        size = cfg["vision_cfg"].get("image_size", 224)
        pretrained_cfg = dict(PREPROCESS, input_size=(3, size, size) if isinstance(size, int) else (3, *size))
        # timm records the tower's build arguments (enable_patch_interpolator among them) as model_args
        save_for_hf(model.visual.trunk, str(folder / TIMM_FOLDER),
                    model_config={"pretrained_cfg": pretrained_cfg, **record}, safe_serialization=True)
