"""Command-line flags of ``naflex-accum train``, with open_clip's names, plus ``--config`` presets.

Invariants: the namespace is complete and valid before anything is created (every bad value a
``UsageError`` naming the flag); a preset only supplies defaults, each through its flag's own parsing;
sequence lengths are kept ascending with their weights, so one set is one run whatever the typed order;
``data_config`` is the one mapping of the flags to a ``DataConfig``. docs/training.md, "Every flag and its default".
"""
import argparse
import math
from pathlib import Path
from typing import List, Optional

import yaml

from ...accum.modes import ACCUM_MODES, DEFAULT_MODE
from ...accum.scales import LOSS_SCALES, check_options
from ...data import DataConfig, check_data_config
from ...errors import OneLineParser, UsageError, check_int, check_ints, first_line
from ...helptext import DefaultsFormatter
from ...models import load_config
from ..model import finetune
from ..output.report import check_wandb
from ..ending.distributed import DEFAULT_TIMEOUT, LONG_TIMEOUT

RUN_CONFIG_DIR = Path(__file__).resolve().parents[2] / "run_configs"
SUPPORTED_PRECISIONS = ("fp32", "amp", "amp_bf16", "amp_bfloat16")
# open_clip's names that cast the weights themselves to 16 bits (no fp32 master weights).
CAST_PRECISIONS = ("bf16", "fp16", "pure_bf16", "pure_fp16")
PRECISIONS = SUPPORTED_PRECISIONS + CAST_PRECISIONS


def build_parser(prog: str = "naflex-accum train") -> argparse.ArgumentParser:
    p = OneLineParser(prog=prog, description="Train a NaFlex CLIP/SigLIP with exact gradient accumulation.",
                      formatter_class=DefaultsFormatter)
    p.add_argument("--config", default=None, help="YAML run preset (configs/runs/NAME.yaml or a path); flags win "
                   "(default: none: every flag's own default)")
    _add_data_args(p.add_argument_group("data"))
    _add_model_args(p.add_argument_group("model and loss"))
    _add_optim_args(p.add_argument_group("optimisation"))
    _add_run_args(p.add_argument_group("run folder and logging"))
    finetune.add_args(p)
    return p


def _add_data_args(d) -> None:
    d.add_argument("--train-data", default=None, help="webdataset shards: braceexpand patterns joined by '::' "
                   "(default: none: required, here or in --config)")
    d.add_argument("--train-num-samples", type=int, default=None,
                   help="samples per epoch (default: the data set's, from sizes.json or a count; more than the "
                        "data set: whole passes, each its own order, and part of one more)")
    d.add_argument("--naflex-num-train-image-tokens", type=int, default=None,
                   help="the epoch's size in image token slots (batch size x sequence length) instead of samples; "
                        "at most one of this and --train-num-samples (default: none)")
    d.add_argument("--val-data", default=None,
                   help="held-out shards for retrieval recall@1/5 (default: none: no held-out evaluation)")
    d.add_argument("--val-seq-len", type=int, default=None, help="eval sequence length (default: largest train one)")
    d.add_argument("--val-batch-size", type=int, default=64, help="held-out images per evaluation batch")
    d.add_argument("--val-at-start", action="store_true", help="also evaluate before the first step")
    d.add_argument("--workers", type=int, default=2, help="data loader workers per process")
    d.add_argument("--data-timeout", type=float, default=600.0,
                   help="seconds the loader (its workers, or the trainer itself with --workers 0) may send no batch "
                        "before the run stops (exit 74); 0: no limit")
    d.add_argument("--data-slots", type=int, default=None,
                   help="slots of the global sample order: a multiple of every world size the run may have; kept "
                        "by a resume inside an epoch (default: world size x --workers at the start)")
    d.add_argument("--sample-shuffle-size", type=int, default=1000,
                   help="samples shuffled together in each data slot: a window of consecutive reads, never two "
                        "passes (open_clip's sample shuffle size); memory about this many encoded samples per "
                        "slot; 0 or 1: shard order within a slot")
    d.add_argument("--image-decode", choices=("scaled", "full"), default="scaled",
                   help="scaled: decode each JPEG at the largest DCT reduction (1/2, 1/4, 1/8) that keeps it at or "
                        "above its NaFlex size, then resize; full: decode every image at full size, then resize "
                        "(slower, the pixels before scaled decoding)")
    d.add_argument("--naflex-seq-lens", type=int, nargs="+", default=[64, 144, 256],
                   help="patch-token sequence lengths a batch may have, each once (taken in ascending order)")
    d.add_argument("--naflex-seq-len-probs", type=float, nargs="+", default=None,
                   help="relative weight of each --naflex-seq-lens value, in the order given (default: equal)")
    d.add_argument("--naflex-max-tokens-per-batch", type=int, default=4096,
                   help="token budget T of a microbatch: length L gets T // L samples, rounded down to a multiple "
                        "of --naflex-batch-divisor")
    d.add_argument("--naflex-batch-divisor", type=int, default=8, help="microbatch sizes are multiples of this")
    d.add_argument("--naflex-patch-sizes", type=int, nargs="+", default=[16],
                   help="patch sizes; with more than one, each batch gets one (the patch embedding resampled); "
                        "one size: the model's own")


def _add_model_args(m) -> None:
    m.add_argument("--model", default="naflex-tiny", help="configs/models/NAME.json or a JSON path")
    m.add_argument("--siglip", action=argparse.BooleanOptionalAction, default=None,
                   help="sigmoid loss (SigLipLoss) and a logit bias (default: what the model config has: "
                        "SigLIP when it sets init_logit_bias)")
    m.add_argument("--local-loss", action="store_true", help="ClipLoss: local logits against global features")
    m.add_argument("--gather-with-grad", action="store_true", help="ClipLoss: all-gather with gradient")


def _add_optim_args(o) -> None:
    o.add_argument("--batch-size", type=int, default=64, help="reference batch size for --naflex-loss-scale")
    o.add_argument("--accum-freq", type=int, default=1, help="microbatches per optimizer step")
    o.add_argument("--accum-mode", choices=ACCUM_MODES, default=DEFAULT_MODE,
                   help="cached-loss: the window loss once per window (GradCache); replay: once per microbatch, "
                        "as upstream; both exact")
    o.add_argument("--naflex-loss-scale", choices=LOSS_SCALES, default="none",
                   help="scale each window's loss by its size against --batch-size: linear, sqrt, or none")
    o.add_argument("--epochs", type=int, default=1, help="epochs to train")
    o.add_argument("--lr", type=float, default=5e-4, help="peak learning rate (AdamW)")
    o.add_argument("--wd", type=float, default=0.2,
                   help="AdamW weight decay (none on gains, biases and the logit parameters)")
    o.add_argument("--beta1", type=float, default=0.9, help="AdamW beta1")
    o.add_argument("--beta2", type=float, default=0.98, help="AdamW beta2")
    o.add_argument("--eps", type=float, default=1e-6, help="AdamW epsilon")
    o.add_argument("--warmup", type=int, default=100, help="warm-up optimizer steps")
    o.add_argument("--lr-scheduler", choices=("cosine", "const"), default="cosine",
                   help="after the warm-up: cosine decay to 0 over the run, or a constant --lr")
    o.add_argument("--grad-clip-norm", type=float, default=None,
                   help="clip the gradient's total norm to this (default: none: no clipping)")
    o.add_argument("--precision", choices=PRECISIONS, default="fp32",
                   help="amp: fp16 autocast with a GradScaler; amp_bf16 (= amp_bfloat16): bf16 autocast; "
                        "open_clip's bf16, fp16, pure_bf16, pure_fp16 (weights cast to 16 bits) are refused")
    o.add_argument("--seed", type=int, default=0, help="seed of the initial weights, the data order and dropout")
    o.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available)")


def _add_run_args(r) -> None:
    r.add_argument("--logs", "--logs-dir", dest="logs", default="./logs",
                   help="parent folder of run folders (--logs-dir: the same, for torchrun, which rejects --logs)")
    r.add_argument("--name", default=None,
                   help="run folder name (default: date, model, lr, batch size, workers, precision)")
    r.add_argument("--resume", default=None,
                   help="checkpoint path, or 'latest' in logs/NAME/checkpoints (with --name) (default: none: a "
                        "new run)")
    r.add_argument("--save-frequency", type=int, default=1,
                   help="checkpoints/epoch_K.pt every N epochs and after the last (0: never)")
    r.add_argument("--save-most-recent", action="store_true",
                   help="also write checkpoints/epoch_latest.pt after every epoch (open_clip's)")
    r.add_argument("--delete-previous-checkpoint", action="store_true",
                   help="after writing epoch_K.pt, delete epoch_{K - save-frequency}.pt (open_clip's)")
    r.add_argument("--save-every-n-steps", type=int, default=0,
                   help="checkpoints/step_G.pt every N optimizer steps, inside epochs too (0: never)")
    r.add_argument("--keep-last", type=int, default=2, help="step_G.pt files kept (the newest)")
    r.add_argument("--check-every-n-steps", type=int, default=10,
                   help="every N optimizer steps at least, all ranks agree on stop requests and check the loss "
                        "is finite (one all-reduce and one device read; logging and saving steps always check)")
    r.add_argument("--dist-timeout", type=float, default=DEFAULT_TIMEOUT, metavar="SECONDS",
                   help="several processes: a collective (from the end of the first step on) waits at most this "
                        "long for a rank, then the run ends on every rank with one line naming the rank that did "
                        f"not answer (exit 74). Start-up and rank 0's evaluations and checkpoint writes may take "
                        f"{LONG_TIMEOUT:g} s (or this, if longer)")
    r.add_argument("--torchcompile", action="store_true",
                   help="torch.compile the model (upstream's 'model' strategy): a graph per sequence length")
    r.add_argument("--torchcompile-backend", default=None, help="torch.compile backend (default: inductor)")
    r.add_argument("--torchcompile-mode", default=None,
                   help="torch.compile mode: default, reduce-overhead, max-autotune, ... (default: torch.compile's "
                        "own)")
    r.add_argument("--fsdp", action="store_true",
                   help="FSDP2 (fully_shard) per transformer block and at the root instead of DDP (torchrun)")
    r.add_argument("--fsdp-no-reshard-after-forward", action="store_true",
                   help="keep gathered parameters from forward to backward (less communication, more memory)")
    r.add_argument("--report-to", default="", help="'tensorboard', 'wandb', 'all', a comma-joined list, or '' "
                   "(none); wandb needs pip install 'naflex-accum[wandb]'")
    r.add_argument("--wandb-project-name", default="open-clip", help="the wandb project (open_clip's default)")
    r.add_argument("--wandb-notes", default="", help="notes for the wandb run")
    r.add_argument("--log-every-n-steps", type=int, default=100,
                   help="a console line every N optimizer steps, and at each epoch's last")


def _resolve_config(path: str) -> Path:
    candidate = Path(path)
    if candidate.suffix not in (".yaml", ".yml"):
        candidate = RUN_CONFIG_DIR / f"{path}.yaml"
    if not candidate.is_file():
        known = ", ".join(sorted(q.stem for q in RUN_CONFIG_DIR.glob("*.yaml")))
        raise UsageError(f"--config {path!r}: no such file; presets are {known}, or pass a YAML path")
    return candidate


def _read_yaml(config_path: Path):
    try:
        with open(config_path) as f:
            return yaml.safe_load(f) or {}
    except yaml.YAMLError as exc:
        def at(mark):
            return f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or first_line(exc)
        context, start = getattr(exc, "context", None), getattr(exc, "context_mark", None)
        opened = f" ({context}{at(start)})" if context and start is not None else ""
        raise UsageError(f"--config {config_path}: YAML syntax error{at(getattr(exc, 'problem_mark', None))}: "
                         f"{problem}{opened}") from None
    except OSError as exc:
        raise UsageError(f"--config {config_path}: cannot read it ({exc.strerror})") from None


def _actions_by_key(parser: argparse.ArgumentParser) -> dict:
    """Preset keys -> actions: each flag's dest and its long names without the dashes."""
    keys = {}
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help", "config"):
            continue
        keys[action.dest] = action
        for option in action.option_strings:
            if option.startswith("--"):
                keys[option[2:].replace("-", "_")] = action
    return keys


def _preset_tokens(action, value) -> list:
    """The command-line words that give ``action`` the preset's ``value``; the flag's own parsing checks them."""
    flag = next(o for o in action.option_strings if o.startswith("--"))
    if action.nargs == 0:  # a switch
        if not isinstance(value, bool):
            raise UsageError(f"expected true or false, got {value!r}")
        if isinstance(action, argparse.BooleanOptionalAction):
            return [flag if value else "--no-" + flag[2:]]
        return [flag] if value == action.const else []
    values = value if isinstance(value, list) else [value]
    if isinstance(value, list) and action.nargs is None:
        raise UsageError(f"expected one value, got the list {value!r}")
    if any(isinstance(v, (list, dict)) for v in values):
        raise UsageError(f"expected {'values' if action.nargs else 'a value'}, got {value!r}")
    return [flag, *(str(v) for v in values)]


def load_preset(parser: argparse.ArgumentParser, path: str) -> dict:
    config_path = _resolve_config(path)
    preset = _read_yaml(config_path)
    if not isinstance(preset, dict):
        raise UsageError(f"--config {config_path}: expected a mapping of flag names to values")
    actions = _actions_by_key(parser)
    out = {}
    for key, value in preset.items():
        action = actions.get(str(key).replace("-", "_"))
        if action is None:
            raise UsageError(f"--config {config_path}: unknown key {key!r} (use train flag names, e.g. accum-freq)")
        if value is None:
            out[action.dest] = None
            continue
        try:
            parsed = parser.parse_args(_preset_tokens(action, value))
        except UsageError as exc:
            raise UsageError(f"--config {config_path}: {key}: {str(exc).split(' (see ')[0]}") from None
        out[action.dest] = getattr(parsed, action.dest)
    return out


def parse_args(argv: Optional[List[str]] = None, prog: str = "naflex-accum train") -> argparse.Namespace:
    parser = build_parser(prog)
    first, _ = parser.parse_known_args(argv)
    if first.config:
        parser.set_defaults(**load_preset(parser, first.config))
    args = parser.parse_args(argv)
    validate(args)
    return args


def _check_precision(args) -> None:
    if args.precision in CAST_PRECISIONS:
        dtype = "bfloat16" if "bf16" in args.precision else "float16"
        raise UsageError(f"--precision {args.precision}: in open_clip this casts the model's weights to {dtype} "
                         f"(no fp32 master weights), which naflex-accum train does not do; use amp_bf16 "
                         f"(bf16 autocast) or amp (fp16 autocast with a GradScaler)")


def _infer_siglip(args) -> None:
    """``--siglip`` unset: the loss the model config was made for (SigLIP when it has a logit bias)."""
    if args.siglip is not None:
        return
    try:
        args.siglip = load_config(args.model).get("init_logit_bias") is not None
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _order_seq_lens(args) -> None:
    """Sequence lengths ascending, each once: the schedule follows their order, so two orders of one set would be
    two runs. Their weights move with them; a note (for the run's log) says when the order changed."""
    lens, probs = list(args.naflex_seq_lens), args.naflex_seq_len_probs
    given = " ".join(str(s) for s in lens)
    repeated = sorted({s for s in lens if lens.count(s) > 1})
    if repeated:
        raise UsageError(f"--naflex-seq-lens {given}: {', '.join(map(str, repeated))} given more than once; give "
                         f"each length once (--naflex-seq-len-probs weighs them)")
    order = sorted(range(len(lens)), key=lens.__getitem__)
    args.naflex_seq_lens = [lens[i] for i in order]
    if probs is not None:
        args.naflex_seq_len_probs = [probs[i] for i in order]
    if args.naflex_seq_lens != lens:
        args.notes.append(f"--naflex-seq-lens {given} taken in ascending order: "
                          f"{' '.join(str(s) for s in args.naflex_seq_lens)}"
                          + (" (their --naflex-seq-len-probs with them)" if probs is not None else ""))


def _check_optimizer(args) -> None:
    """AdamW's own ranges, and finite numbers: a value outside them trains wrongly or fails late."""
    finite = math.isfinite
    if not (finite(args.lr) and args.lr > 0):
        raise UsageError(f"--lr must be a finite number > 0; got {args.lr}")
    if not (finite(args.wd) and args.wd >= 0):
        raise UsageError(f"--wd must be a finite number >= 0 (AdamW's weight decay); got {args.wd}")
    for flag, beta in (("--beta1", args.beta1), ("--beta2", args.beta2)):
        if not 0 <= beta < 1:
            raise UsageError(f"{flag} must be in [0, 1) (AdamW's moment decay); got {beta}")
    if not (finite(args.eps) and args.eps > 0):
        raise UsageError(f"--eps must be a finite number > 0; got {args.eps}")
    if args.grad_clip_norm is not None and not (finite(args.grad_clip_norm) and args.grad_clip_norm > 0):
        raise UsageError(f"--grad-clip-norm must be a finite norm > 0 (leave it out for no clipping); "
                         f"got {args.grad_clip_norm}")


def data_config(args, rank: int = 0, world_size: int = 1) -> DataConfig:
    """The one mapping of the data flags to the ``DataConfig`` of ``rank`` of ``world_size`` (no shard index yet)."""
    return DataConfig(
        train_data=args.train_data, seq_lens=tuple(args.naflex_seq_lens),
        seq_len_probs=tuple(args.naflex_seq_len_probs) if args.naflex_seq_len_probs else None,
        max_tokens_per_batch=args.naflex_max_tokens_per_batch, batch_divisor=args.naflex_batch_divisor,
        patch_sizes=tuple(args.naflex_patch_sizes), num_samples=args.train_num_samples,
        num_image_tokens=args.naflex_num_train_image_tokens, accum_freq=args.accum_freq, seed=args.seed,
        workers=args.workers, rank=rank, world_size=world_size, timeout=args.data_timeout, slots=args.data_slots,
        image_decode=args.image_decode, sample_shuffle_size=args.sample_shuffle_size,
        dataset_resampled=args.dataset_resampled, upsampling_factors=args.train_data_upsampling_factors)


def validate(args) -> None:
    args.notes = []  # one-line remarks about how flags were taken, for the run's log (and params.txt)
    if not args.train_data:
        raise UsageError("--train-data is required: webdataset shards, e.g. 'data/train-{0000..0009}.tar'")
    if args.resume is not None and not args.resume.strip():
        raise UsageError("--resume is empty; give a checkpoint path, or 'latest' with --name")
    if args.resume == "latest" and args.name is None:
        raise UsageError("--resume latest needs --name: without it each start makes a new dated run folder, which "
                         "no later start could find; add --name NAME (the folder under --logs to resume)")
    check_ints(args, 1, "epochs", "val_batch_size", "log_every_n_steps", "val_seq_len", "check_every_n_steps")
    check_ints(args, 0, "warmup", "save_frequency", "save_every_n_steps", "keep_last")
    _check_optimizer(args)
    if not (args.dist_timeout > 0 and args.dist_timeout != float("inf")):
        raise UsageError(f"--dist-timeout must be a number of seconds > 0; got {args.dist_timeout}")
    if args.save_every_n_steps and args.keep_last < 1:
        raise UsageError("--keep-last must be at least 1 with --save-every-n-steps (0 would delete every "
                         "step checkpoint as it is written)")
    _check_precision(args)
    _infer_siglip(args)
    try:
        check_options(args.naflex_loss_scale, args.batch_size, naflex=True)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    check_data_config(data_config(args))  # the data flags: data/ checks them, each once
    _order_seq_lens(args)
    check_wandb(args.report_to)  # also refuses values that name no sink
    if args.fsdp and args.torchcompile:
        raise UsageError("--fsdp with --torchcompile is not offered here (upstream compiles per block inside "
                         "FSDP); use one of them")
    if args.siglip and (args.local_loss or args.gather_with_grad):
        raise UsageError("--local-loss and --gather-with-grad apply to the CLIP loss, not --siglip")
    if args.name is not None and (not args.name or "/" in args.name or args.name in (".", "..")):
        raise UsageError(f"--name {args.name!r}: use a plain folder name (not empty, '.' or '..', no '/')")
    if args.name is not None and len(args.name.encode()) > 255:
        raise UsageError(f"--name is {len(args.name.encode())} bytes long: a folder name holds at most 255")
    if args.val_seq_len is not None and args.val_seq_len > args.naflex_max_tokens_per_batch:
        raise UsageError(f"--val-seq-len {args.val_seq_len} exceeds --naflex-max-tokens-per-batch "
                         f"{args.naflex_max_tokens_per_batch}: an evaluation image may hold at most the budget")
    finetune.validate(args)
