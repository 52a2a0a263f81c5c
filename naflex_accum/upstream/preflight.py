"""What the runner refuses before upstream's ``main`` starts, and whether a run calls the fixed step at all.

Invariant: ``refusal(args)`` reads only upstream's parsed arguments, the launcher's variables and the files they
name, so it runs before any run folder or process group; it names in one line the first setting upstream's
``main`` would crash on or silently mistrain. ``step_use(args)`` is ``train_one_epoch``'s own rule for calling
the step. docs/upstream.md, "What the runner refuses before upstream starts".
"""
import math
import os
from dataclasses import dataclass
from typing import Optional, Tuple

from braceexpand import braceexpand

from ..accum.scales import validate_mode
from ..errors import StepError, is_positive_int
from . import locks

SYNTHETIC = ("synthetic", "synthetic-audio")  # upstream's dataset types that need no --train-data
FSDP_SCALED = ("amp", "fp16", "pure_fp16")  # upstream's FSDP param dtype float16: a GradScaler
TOKEN_FLAGS = ("naflex_max_tokens_per_batch", "naflex_max_image_tokens_per_batch")  # 89fb801, 5964c41
_MISSING = object()


@dataclass(frozen=True)
class StepUse:
    used: bool
    why: str


def _get(args, name):
    return getattr(args, name, _MISSING)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _distributed_world() -> Optional[str]:
    """``VAR=N`` when upstream's ``main`` will set up a process group (its ``is_using_distributed``), else None."""
    import open_clip_train.distributed as upstream  # upstream's trainer: imported only when a run is checked

    try:
        if not upstream.is_using_distributed():
            return None
    except ValueError:  # a variable that is not a number: upstream's own error, in its own time
        return None
    var = "WORLD_SIZE" if "WORLD_SIZE" in os.environ else "SLURM_NTASKS"  # upstream reads them in this order
    return f"{var}={os.environ[var]}"


def _falls_back_to_cpu(device: str) -> bool:
    """Whether upstream's ``init_distributed_device`` runs ``device`` on the CPU (its ``is_device_available``)."""
    import open_clip_train.distributed as upstream  # see above

    kind = device.split(":", 1)[0]
    available, known = upstream.is_device_available(kind)
    return kind == "cpu" or (known and not available)


def _scaler(args) -> Optional[str]:
    """Why upstream's ``main`` creates a GradScaler for this run, or None when it does not."""
    precision, fsdp = _get(args, "precision"), _get(args, "fsdp") is True and _distributed_world() is not None
    if fsdp and precision in FSDP_SCALED:
        return f"--fsdp with --precision {precision}"
    if not fsdp and precision == "amp":
        return "--precision amp"
    return None


def step_use(args) -> StepUse:
    """Whether upstream's loop calls ``_train_step_eager`` in this run, and why (unknown arguments: it does)."""
    k = _get(args, "accum_freq")
    if k is _MISSING or _get(args, "precision") is _MISSING:
        return StepUse(True, "upstream's arguments do not say")
    if k > 1:
        return StepUse(True, f"--accum-freq {k}")
    scaler = _scaler(args)
    if scaler is not None:
        return StepUse(True, f"{scaler}: upstream's GradScaler routes every batch through it")
    return StepUse(False, f"--accum-freq 1 with --precision {_get(args, 'precision')}: upstream trains each batch "
                          f"with its own one-batch step, whose batch is the whole window, so its loss scale is "
                          f"already the window's")


def _accum_freq(args) -> Optional[str]:
    k = _get(args, "accum_freq")
    if k is not _MISSING and not is_positive_int(k):
        return (f"--accum-freq {k}: use 1 (an optimizer step per batch) or more (batches accumulated per "
                f"optimizer step)")
    return None


def _missing_files(spec: str) -> list:
    """The local files that ``spec`` (upstream's '::'-joined braceexpand patterns) names and that do not exist;
    ``pipe:`` commands and URLs are not checked here (they may only read at run time)."""
    local = [p for part in spec.split("::") if part and "://" not in part and not part.startswith("pipe:")
             for p in braceexpand(part)]
    return [p for p in local if not os.path.exists(p)]


def _train_data(args) -> Optional[str]:
    data, kind = _get(args, "train_data"), _get(args, "dataset_type")
    if data is _MISSING or kind is _MISSING or kind in SYNTHETIC:
        return None
    if not data:
        return ("no --train-data: the runner trains; give --train-data (webdataset shards or a CSV) or "
                "--dataset-type synthetic. To only evaluate, run upstream's own `python -m open_clip_train.main`")
    missing = _missing_files(str(data))
    if missing:  # upstream's webdataset loader would skip the missing file forever
        return (f"--train-data: {len(missing)} file(s) not found (first {missing[0]!r}); give existing "
                f"shards or a CSV")
    return None


def _distillation(args) -> Optional[str]:
    model, pretrained = _get(args, "distill_model"), _get(args, "distill_pretrained")
    if model is _MISSING or pretrained is _MISSING or (model is None and pretrained is None):
        return None
    if model is None or pretrained is None:
        given, missing = ("--distill-model", "--distill-pretrained") if pretrained is None else \
            ("--distill-pretrained", "--distill-model")
        return (f"{given} without {missing}: upstream distils only with both (with one alone it trains without "
                f"a teacher); give both or neither")
    k = _get(args, "accum_freq")
    if k is not _MISSING and k > 1:
        return (f"--distill-model with --accum-freq {k}: upstream's distillation trains only at --accum-freq 1 "
                f"(its main asserts it); drop --accum-freq or the distillation")
    if "coca" in str(_get(args, "model")).lower():
        return (f"--distill-model with --model {_get(args, 'model')}: upstream's distillation does not train "
                f"CoCa models (its main asserts it); distil into a CLIP or SigLIP model")
    return None


def _step_settings(args) -> Optional[str]:
    """The settings the fixed step reads (and upstream's own step and data pipeline before it)."""
    batch = _get(args, "batch_size")
    if batch is not _MISSING and not is_positive_int(batch):
        return (f"--batch-size {batch}: use 1 or more (the per-GPU batch; with --use-naflex, the reference batch "
                f"size that --naflex-loss-scale linear and sqrt divide by)")
    mode = _get(args, "naflex_loss_scale")
    try:
        validate_mode(None if mode is _MISSING else mode)
    except StepError as exc:
        return " ".join(str(exc).split())
    return None


def _naflex_schedule(args) -> Optional[str]:
    """Upstream's NaFlex batch schedule refuses these once the run folder exists; here before."""
    if _get(args, "use_naflex") is not True:
        return None
    seq_lens = _get(args, "naflex_seq_lens")
    if isinstance(seq_lens, list) and not all(is_positive_int(s) for s in seq_lens):
        return f"--naflex-seq-lens {' '.join(map(str, seq_lens))}: every sequence length must be 1 or more tokens"
    probs = _get(args, "naflex_seq_len_probs")
    if isinstance(probs, list) and isinstance(seq_lens, list):
        if len(probs) != len(seq_lens):
            return (f"--naflex-seq-len-probs has {len(probs)} values, --naflex-seq-lens {len(seq_lens)}: give one "
                    f"weight per sequence length")
        if not (all(p >= 0 for p in probs) and math.isfinite(sum(probs)) and sum(probs) > 0):
            return f"--naflex-seq-len-probs {' '.join(map(str, probs))}: give weights >= 0 with a positive sum"
    for name in (*TOKEN_FLAGS, "naflex_batch_divisor"):
        value = _get(args, name)
        if value is not _MISSING and not is_positive_int(value):
            return f"{_flag(name)} {value}: use 1 or more"
    return None


def _ddp_on_cpu(args) -> Optional[str]:
    device = _get(args, "device")
    if device is _MISSING or _get(args, "fsdp") is True:
        return None
    world = _distributed_world()
    if world is None or not _falls_back_to_cpu(str(device)):
        return None
    where = ("--device cpu" if str(device).startswith("cpu") else
             f"--device {device} (not available here: upstream falls back to the CPU)")
    return (f"{where} with {world}: upstream's main cannot train DDP on the CPU (it wraps the model in "
            f"DistributedDataParallel(device_ids=[cpu]), which torch refuses); run one process on the CPU, use "
            f"GPUs, or `naflex-accum train`, whose DDP runs on the CPU")


def _compiled_step(args) -> Optional[str]:
    if _get(args, "torchcompile") is not True or _get(args, "torchcompile_strategy") != "step":
        return None
    use = step_use(args)
    if not use.used:
        return None
    return (f"--torchcompile-strategy step with {use.why.split(':')[0]}: upstream compiles only its one-batch "
            f"step (--accum-freq 1, no GradScaler); use --torchcompile-strategy task or model")


CHECKS = (_accum_freq, _train_data, _step_settings, _naflex_schedule, _distillation, locks.refusal, _ddp_on_cpu,
          _compiled_step)
OWN_NODE = (_train_data, locks.refusal)  # they read files: one node may lack what rank 0's has


def refusal(args) -> Optional[Tuple[str, bool]]:
    """The one line refusing this run before upstream's ``main`` starts, and whether it read this node's files
    (else every rank meets it alike); None when upstream can take it."""
    for check in CHECKS:
        line = check(args)
        if line is not None:
            return line, check in OWN_NODE
    return None
