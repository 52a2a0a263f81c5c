"""Every flag of upstream open_clip main's ``open_clip_train/params.py``, and what ``naflex-accum train`` does with it.

Invariant: each upstream flag is in ``FLAGS``, ``works``, ``limited`` (to ``allowed``) or ``refused`` (exit 2
with its one-line reason, in a ``--config`` preset too). A test keeps docs/training.md's table, which is
generated from ``FLAGS``, and the pinned upstream snapshot's parser equal to it.
"""
import argparse
from typing import Dict, NamedTuple, Tuple

from ...errors import UsageError


class Flag(NamedTuple):
    status: str  # "works", "limited" or "refused"
    note: str = ""  # works: how it differs, if at all; limited/refused: why, in one line
    allowed: Tuple[str, ...] = ()  # limited: the values that keep upstream's meaning here


W, L, R = "works", "limited", "refused"
_AUDIO = Flag(R, "audio models (CLAP) are not trained here: image-text CLIP/SigLIP only")
_CSV = Flag(R, "csv data is not read here: webdataset shards only")
_REMOTE = Flag(R, "remote sync is not offered: copy logs/NAME yourself (checkpoints are written atomically)")
_BUCKETS = Flag(R, "captions are padded to the model's context length; there is no length bucketing")
_NOOP = "accepted; it has no effect on these models, as upstream"
_JSON = Flag(R, "captions come from the .txt member, not from a .json field")
_NORM = Flag(R, "patches are normalised with open_clip's CLIP mean and std")
_DISTILL = Flag(R, "distillation is not supported (upstream does not accumulate it either)")
_COCA = Flag(R, "CoCa is not trained here: CLIP/SigLIP only")
_COOLDOWN = Flag(R, "the const-cooldown schedule is not offered: --lr-scheduler cosine or const")
_ADAMW = "the optimizer is AdamW (--lr, --beta1, --beta2, --eps, --wd)"

FLAGS: Dict[str, Flag] = {
    # data
    "--train-data": Flag(W, "webdataset shards only; sources joined by '::'"),
    "--train-data-upsampling-factors": Flag(W, "one factor per '::' source; needs --dataset-resampled"),
    "--val-data": Flag(W, "held-out retrieval R@1/R@5, mean rank and loss"),
    "--train-num-samples": Flag(W),
    "--val-num-samples": Flag(R, "not needed: the held-out set is read to its end and counted"),
    "--dataset-type": Flag(L, "only webdataset shards are read (no csv, synthetic or audio data)",
                           ("webdataset", "auto")),
    "--dataset-resampled": Flag(W),
    "--audio-ext": _AUDIO, "--pretrained-audio": _AUDIO, "--audio-fill": _AUDIO, "--audio-trunc": _AUDIO,
    "--audio-fusion": _AUDIO, "--audio-int16-normalize": _AUDIO, "--audio-zeroshot-dataset": _AUDIO,
    "--audio-zeroshot-split": _AUDIO, "--audio-zeroshot-audio-key": _AUDIO,
    "--audio-zeroshot-target-key": _AUDIO, "--audio-zeroshot-class-key": _AUDIO,
    "--audio-zeroshot-template": _AUDIO, "--audio-zeroshot-workers": _AUDIO,
    "--audio-zeroshot-multiprocessing-context": _AUDIO, "--audio-multiprocessing-context": _AUDIO,
    "--audio-layer-decay": _AUDIO,
    "--csv-separator": _CSV, "--csv-img-key": _CSV, "--csv-caption-key": _CSV,
    "--image-key": Flag(L, "the image is the first of .jpg/.png/.jpeg/.webp in a sample", ("jpg;png;jpeg;webp",)),
    "--text-key": Flag(L, "the caption is the sample's .txt member", ("txt",)),
    "--json-text-key": _JSON, "--json-text-key-probs": _JSON,
    "--max-image-pixels": Flag(R, "not configurable: images are opened lazily and decoded at the batch's size"),
    "--imagenet-val": Flag(W, "an ImageNet val folder (class subfolders, ImageFolder order)"),
    "--imagenet-v2": Flag(W, "an ImageNetV2 folder (subfolders 0..999); nothing is downloaded"),
    "--cache-dir": Flag(R, "nothing is downloaded: models come from local configs, weights from --pretrained FILE"),
    # run folder and logging
    "--logs": Flag(W), "--name": Flag(W),
    "--log-local": Flag(R, "only global rank 0 writes logs"),
    "--report-to": Flag(W, "wandb needs the extra: pip install 'naflex-accum[wandb]'; its files go to "
                           "logs/NAME/wandb"),
    "--wandb-notes": Flag(W), "--wandb-project-name": Flag(W),
    "--debug": Flag(R, "there is no debug logging mode"),
    "--copy-codebase": Flag(R, "the code is an installed package; params.txt records the flags"),
    "--log-every-n-steps": Flag(W),
    "--log-metric-every-n-steps": Flag(R, "tensorboard gets every optimizer step's scalars"),
    "--train-loss-ema-samples": Flag(L, "the console shows the epoch's running average, as upstream with 0", ("0",)),
    "--save-frequency": Flag(W),
    "--save-most-recent": Flag(W, "also epoch_latest.pt after every epoch"),
    "--delete-previous-checkpoint": Flag(W),
    "--remote-sync": _REMOTE, "--remote-sync-frequency": _REMOTE, "--remote-sync-protocol": _REMOTE,
    "--resume": Flag(W, "a path or 'latest'; wins over --pretrained"),
    # evaluation
    "--zeroshot-frequency": Flag(W, "with --imagenet-val/--imagenet-v2, or a local class list (--zeroshot-classes)"),
    "--val-frequency": Flag(W),
    "--val-retrieval-chunk-size": Flag(R, "retrieval is scored as one fp32 matrix on the CPU (as upstream's 0)"),
    "--val-retrieval-precision": Flag(L, "retrieval is scored in fp32", ("fp32",)),
    # model
    "--model": Flag(W, "configs/models/NAME.json (a NaFlexVit image tower) or a JSON path; no hub names"),
    "--pretrained": Flag(W, "a local file: open_clip checkpoint, a run's epoch_K.pt, or timm NaFlexVit/ViT image "
                            "tower weights; no tags (they need a download)"),
    "--pretrained-image": Flag(R, "downloads ImageNet weights: pass a local timm weights file as --pretrained FILE"),
    "--lock-image": Flag(W, "upstream main's meaning: the whole image tower, projection included"),
    "--lock-image-unlocked-groups": Flag(W, "counts timm's layer groups from the top, the projection first"),
    "--lock-image-freeze-bn-stats": Flag(W, _NOOP + " (NaFlexVit has no BatchNorm)"),
    "--lock-text": Flag(W),
    "--lock-text-unlocked-layers": Flag(W),
    "--lock-text-freeze-layer-norm": Flag(W, _NOOP + " (LayerNorm keeps no running statistics)"),
    "--text-pooler-own-group": Flag(W, _NOOP + " (open_clip's text tower has no readout pooler)"),
    "--grad-checkpointing": Flag(W, "the model's own set_grad_checkpointing(True): both towers"),
    "--force-patch-dropout": Flag(W),
    "--force-context-length": Flag(R, "set text_cfg.context_length in a model JSON (--model PATH)"),
    "--force-image-size": Flag(R, "NaFlex has no fixed image size: --naflex-seq-lens sets the tokens per image"),
    "--force-quick-gelu": Flag(R, "set quick_gelu in a model JSON (--model PATH)"),
    "--force-custom-text": Flag(R, "the text tower is open_clip's native CLIP text tower"),
    "--force-naflex-vision": Flag(W, _NOOP + " (the image tower is always a NaFlexVit)"),
    "--use-naflex": Flag(W, _NOOP + " (NaFlex batching is always on)"),
    "--image-mean": _NORM, "--image-std": _NORM,
    "--image-interpolation": Flag(R, "images are resized bicubic to fit the sequence length"),
    "--image-resize-mode": Flag(R, "NaFlex keeps each image's aspect ratio; no crop or squash"),
    "--aug-cfg": Flag(R, "no augmentation beyond the NaFlex resize"),
    "--use-bnb-linear": Flag(R, "bitsandbytes layers are not supported"),
    "--distill-model": _DISTILL, "--distill-pretrained": _DISTILL,
    "--coca-caption-loss-weight": _COCA, "--coca-contrastive-loss-weight": _COCA,
    "--siglip": Flag(W), "--local-loss": Flag(W), "--gather-with-grad": Flag(W),
    "--loss-dist-impl": Flag(R, "each loss uses open_clip 3.3.0's default distributed implementation"),
    # optimisation
    "--batch-size": Flag(W, "the reference batch size of --naflex-loss-scale; NaFlex batches come from the budget"),
    "--epochs": Flag(W), "--lr": Flag(W), "--beta1": Flag(W), "--beta2": Flag(W), "--eps": Flag(W), "--wd": Flag(W),
    "--warmup": Flag(W), "--accum-freq": Flag(W, "exact: split-invariant window scale"), "--seed": Flag(W),
    "--grad-clip-norm": Flag(W),
    "--precision": Flag(W, "fp32, amp (fp16 autocast with a GradScaler), amp_bf16/amp_bfloat16 (bf16 autocast); "
                           "bf16, fp16, pure_bf16, pure_fp16 cast the weights themselves and are refused with "
                           "that reason"),
    "--lr-scheduler": Flag(W, "cosine or const"),
    "--epochs-cooldown": _COOLDOWN, "--lr-cooldown-end": _COOLDOWN, "--lr-cooldown-power": _COOLDOWN,
    "--skip-scheduler": Flag(R, "use --lr-scheduler const --warmup 0 (a constant --lr)"),
    "--momentum": Flag(R, "for timm optimizers; the optimizer is AdamW"),
    "--opt": Flag(L, _ADAMW, ("adamw",)), "--opt-kwargs": Flag(R, _ADAMW),
    "--opt-fallback-list": Flag(R, "Muon-family optimizers are not offered; the optimizer is AdamW"),
    "--text-layer-decay": Flag(R, "layer-wise LR decay is not offered; --lock-text-unlocked-layers freezes instead"),
    "--image-layer-decay": Flag(R, "layer-wise LR decay is not offered; --lock-image-unlocked-groups freezes instead"),
    "--visual-layer-decay": Flag(R, "layer-wise LR decay is not offered; --lock-image-unlocked-groups freezes "
                                    "instead"),
    "--wd-exclude": Flag(R, "no weight decay on 1-D parameters, biases, norms and logit_scale (fixed)"),
    "--use-bn-sync": Flag(W, _NOOP + " (no BatchNorm)"),
    "--torchcompile": Flag(W, "the model, before DDP; batch dimension dynamic, nothing compiles after the "
                              "first epoch; Inductor draws eager's random numbers (the same masks)"),
    "--torchcompile-strategy": Flag(L, "the model is compiled ('task' and 'step' are not offered)", ("model",)),
    "--torchcompile-backend": Flag(W), "--torchcompile-mode": Flag(W),
    # devices and processes
    "--device": Flag(W, "cpu, cuda or cuda:N; default cuda when available; one not there: one line, exit 2"),
    "--workers": Flag(W, "they live across epochs (CPU too); one that dies, raises or hangs for --data-timeout "
                         "seconds ends the run, exit 74"),
    "--dist-url": Flag(R, "the process group comes from torchrun's (or SLURM's) environment"),
    "--dist-backend": Flag(R, "nccl on CUDA, gloo on the CPU, chosen from --device"),
    "--no-set-device-rank": Flag(R, "each rank uses cuda:LOCAL_RANK, or the device --device names"),
    "--ddp-static-graph": Flag(R, "DDP runs with its defaults"),
    "--fsdp": Flag(W, "FSDP2 per block and at the root, fp32 parameters; checkpoints are full state dicts, "
                      "which runs with or without --fsdp resume"),
    "--fsdp-no-reshard-after-forward": Flag(W),
    "--fsdp-offload-cpu": Flag(R, "not offered: CPU offload is untested without a GPU here"),
    "--fsdp-checkpoint": Flag(L, "full state dicts only (what --pretrained and a run without --fsdp load)",
                              ("full",)),
    # NaFlex
    "--naflex-num-train-image-tokens": Flag(W), "--naflex-patch-sizes": Flag(W), "--naflex-seq-lens": Flag(W),
    "--naflex-seq-len-probs": Flag(W), "--naflex-max-tokens-per-batch": Flag(W), "--naflex-batch-divisor": Flag(W),
    "--naflex-loss-scale": Flag(W, "one scale per window (split-invariant), not one per microbatch"),
    "--naflex-patch-size-probs": Flag(R, "patch sizes take equal shares of each epoch's batches"),
    "--naflex-max-text-tokens": Flag(R, "GenLIP only"),
    "--naflex-pad-multiple": Flag(R, "NaFlex audio only"),
    "--text-pad-multiple": Flag(R, "captions are padded to the model's context length"),
    "--length-bucketing": _BUCKETS, "--bucket-pool": _BUCKETS, "--bucket-chunk": _BUCKETS,
    "--bucket-prefetch-pools": _BUCKETS,
}


def _message(option: str, flag: Flag, value=None) -> str:
    if flag.status == L:
        shown = ", ".join(repr(v) for v in flag.allowed)
        return f"{option} {value!r}: {flag.note}; valid values here: {shown}"
    return f"{option} is an open_clip flag this trainer does not support: {flag.note}"


class _Refuse(argparse.Action):
    """Raise the flag's reason when used (on the command line, or later from a preset)."""

    def __call__(self, parser, namespace, values, option_string=None):
        raise UsageError(_message(option_string, FLAGS[option_string]))


class _Limited(argparse.Action):
    """Store a value that keeps upstream's meaning here; refuse any other."""

    def __call__(self, parser, namespace, values, option_string=None):
        flag = FLAGS[option_string]
        if values not in flag.allowed:
            raise UsageError(_message(option_string, flag, values))
        setattr(namespace, self.dest, values)


def register(parser: argparse.ArgumentParser) -> None:
    """Add every refused or limited upstream flag the parser lacks (hidden from --help); a refused one takes any
    number of values, so that its reason, not argparse's arity error, is what the user sees."""
    known = set(parser._option_string_actions)
    for option, flag in FLAGS.items():
        if option in known or flag.status == W:
            continue
        if flag.status == L:
            parser.add_argument(option, action=_Limited, default=flag.allowed[0], help=argparse.SUPPRESS)
        else:
            parser.add_argument(option, action=_Refuse, nargs="*", default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def check_namespace(args: argparse.Namespace) -> None:
    """Refuse a refused flag, or a limited one's other value, from a ``--config`` preset: argparse calls no
    action for a preset's value, and a refused flag is in the namespace only when a preset set it."""
    for option, flag in FLAGS.items():
        dest = option[2:].replace("-", "_")
        if flag.status == W or not hasattr(args, dest):
            continue
        value = getattr(args, dest)
        if flag.status == R or str(value) not in flag.allowed:
            raise UsageError(f"--config: {_message(option, flag, value)}")


def markdown_table() -> str:
    """The flag table of docs/training.md."""
    lines = ["| upstream flag | here | why / how it differs |", "|---|---|---|"]
    for option, flag in sorted(FLAGS.items()):
        status = flag.status if flag.status != L else "only " + ", ".join(f"`{v}`" for v in flag.allowed if v)
        lines.append(f"| `{option}` | {status} | {flag.note} |")
    return "\n".join(lines)


if __name__ == "__main__":  # the table for docs/training.md
    print(markdown_table())
