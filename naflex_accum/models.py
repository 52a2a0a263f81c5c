"""NaFlex CLIP models built from open_clip's own classes with a timm NaFlexVit trunk.

Invariant: a model made here is an ``open_clip.model.CLIP`` whose image tower is open_clip's ``TimmModel``
around a timm ``NaFlexVit``, so its state_dict is open_clip's and ``open_clip.create_model`` loads it from the same
config (after ``register()``: the timm sizes and ``_flexi`` names, never at import). Several ``patch_sizes`` keep
the same parameters, the tower built with timm's ``enable_patch_interpolator``. docs/api.md, "Models and tasks".
"""
import copy
import dataclasses
import json
import math
from pathlib import Path
from typing import Optional, Sequence

import open_clip
import timm
import torch.nn as nn
from open_clip.coca_model import CoCa
from open_clip.model import CLIP
from timm.data import IMAGENET_INCEPTION_MEAN, IMAGENET_INCEPTION_STD
from timm.models import build_model_with_cfg, is_model, register_model, split_model_name_tag
from timm.models.naflexvit import NaFlexVit, NaFlexVitCfg, checkpoint_filter_fn

CONFIG_DIR = Path(__file__).resolve().parent / "model_configs"
ANY_PATCH_SUFFIX = "_flexi"  # a timm tower's name + this: the same tower taking any patch size

# Extra timm NaFlexVit sizes: name -> NaFlexVitCfg fields.
TIMM_SIZES = {
    "naflexvit_tiny_patch16_gap": dict(
        patch_size=16, embed_dim=32, depth=2, num_heads=2, global_pool="avg", reg_tokens=1, fc_norm=True),
    "naflexvit_small_patch16_gap": dict(
        patch_size=16, embed_dim=384, depth=12, num_heads=6, init_values=1e-5, global_pool="avg",
        reg_tokens=4, fc_norm=True),
}


default_cfgs: dict = {}


def register_timm_models() -> None:
    """Add the NaFlexVit sizes above and their any-patch-size names to timm's registry (idempotent, public API)."""
    for name, fields in TIMM_SIZES.items():
        if is_model(name):
            continue
        # register_model reads the entry's default config from its module's
        # ``default_cfgs``; without one timm warns on every create.
        default_cfgs[name] = dict(url="", num_classes=1000, input_size=(3, 224, 224), pool_size=None, crop_pct=1.0,
                                  interpolation="bicubic", mean=IMAGENET_INCEPTION_MEAN, std=IMAGENET_INCEPTION_STD,
                                  first_conv="embeds.proj", classifier="head", license="apache-2.0")

        def factory(pretrained: bool = False, _name=name, _fields=fields, **kwargs):
            return _build_naflexvit(_name, pretrained, NaFlexVitCfg(**_fields), **kwargs)

        factory.__name__ = name
        factory.__module__ = __name__
        register_model(factory)
    for name in timm.list_models("naflexvit_*"):
        any_patch_size(name)


def any_patch_size(timm_name: str) -> str:
    """The timm name, registered here, of tower ``timm_name`` taking ``[B, L, P, P, C]`` patches of any size:
    timm's ``enable_patch_interpolator=True`` (no parameters: the state_dict is the plain tower's)."""
    base, tag = split_model_name_tag(timm_name)
    if not base.endswith(ANY_PATCH_SUFFIX):
        variant = base + ANY_PATCH_SUFFIX
        if not is_model(variant):
            def factory(pretrained: bool = False, _base=base, **kwargs):
                return timm.create_model(_base, pretrained, **dict(kwargs, enable_patch_interpolator=True))

            factory.__name__ = variant
            factory.__module__ = __name__
            register_model(factory)
        base = variant
    return f"{base}.{tag}" if tag else base


def _build_naflexvit(name: str, pretrained: bool, cfg: NaFlexVitCfg, out_indices=3, **kwargs) -> NaFlexVit:
    """A NaFlexVit as timm builds its own (``build_model_with_cfg``); ``kwargs`` override ``cfg``'s fields."""
    names = {f.name for f in dataclasses.fields(NaFlexVitCfg)}
    cfg = dataclasses.replace(cfg, **{k: kwargs.pop(k) for k in list(kwargs) if k in names})
    return build_model_with_cfg(NaFlexVit, name, pretrained, pretrained_filter_fn=checkpoint_filter_fn, cfg=cfg,
                                feature_cfg=dict(out_indices=out_indices, feature_cls="getter"), **kwargs)


def register() -> None:
    """Let plain open_clip and timm build these models (timm's registry the sizes above and the ``_flexi`` names,
    open_clip's the model configs by name: ``open_clip.create_model("naflex-B-16")``). Idempotent."""
    register_timm_models()
    if not set(list_models()) <= set(open_clip.list_models()):
        open_clip.add_model_config(CONFIG_DIR)


def list_models():
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def load_config(name_or_path: str) -> dict:
    """A model config by name (``configs/models/NAME.json``) or by JSON path (a model config, or an
    ``open_clip_config.json`` of a ``local-dir:`` model, whose ``model_cfg`` it is)."""
    path = Path(name_or_path)
    if path.suffix != ".json":
        path = CONFIG_DIR / f"{name_or_path}.json"
    if not path.is_file():
        raise ValueError(
            f"--model {name_or_path!r}: no such model config; known models are "
            f"{', '.join(list_models())}, or pass a path to an open_clip-style JSON config.")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--model {name_or_path!r}: cannot read it as JSON ({exc})") from None
    cfg = cfg.get("model_cfg", cfg) if isinstance(cfg, dict) else cfg
    if not isinstance(cfg, dict) or not isinstance(cfg.get("vision_cfg"), dict):
        raise ValueError(f"--model {name_or_path!r}: not an open_clip model config (no vision_cfg)")
    return cfg


def set_attention_dropout(module: nn.Module, p: float) -> None:
    """Dropout ``p`` in every ``nn.MultiheadAttention`` under ``module``."""
    for sub in module.modules():
        if isinstance(sub, nn.MultiheadAttention):
            sub.dropout = p


def create_model(
        name_or_config="naflex-tiny",
        *,
        siglip: Optional[bool] = None,
        patch_dropout: Optional[float] = None,
        drop_path: Optional[float] = None,
        patch_sizes: Optional[Sequence[int]] = None,
        text_dropout: float = 0.0,
        grad_checkpointing: bool = False,
):
    """An open_clip ``CLIP`` with a NaFlexVit image tower, returning a dict; several ``patch_sizes`` take patches
    of any size; ``siglip`` forces a ``logit_bias`` (init -10, scale ln 10) on or off (``None``: the config's)."""
    register_timm_models()
    model = CLIP(**model_config(name_or_config, siglip=siglip, patch_dropout=patch_dropout, drop_path=drop_path,
                                patch_sizes=patch_sizes), output_dict=True)
    if text_dropout:  # open_clip 3.3.0 has no config field for text-tower attention dropout
        set_attention_dropout(model.transformer, text_dropout)
    if grad_checkpointing:
        model.set_grad_checkpointing(True)
    return model


def takes_flat_patches(patch_sizes: Optional[Sequence[int]]) -> bool:
    """Whether the tower for ``patch_sizes`` takes flattened ``[B, L, P*P*C]`` patches (one size) rather than
    ``[B, L, P, P, C]`` of any size (several): every batch it is given, trained or evaluated, is shaped so."""
    return patch_sizes is None or len(patch_sizes) < 2


def model_config(name_or_config="naflex-tiny", *, siglip: Optional[bool] = None,
                 patch_dropout: Optional[float] = None, drop_path: Optional[float] = None,
                 patch_sizes: Optional[Sequence[int]] = None) -> dict:
    """The open_clip ``model_cfg`` ``create_model`` builds ``CLIP`` from (a copy; see there for the options):
    the same dict builds the same model in open_clip's own factory (after ``register()``)."""
    cfg = copy.deepcopy(name_or_config if isinstance(name_or_config, dict) else load_config(name_or_config))
    if not takes_flat_patches(patch_sizes):
        tower = cfg["vision_cfg"].get("timm_model_name")
        if not tower:
            raise ValueError(f"--naflex-patch-sizes {' '.join(map(str, patch_sizes))}: several patch sizes need a "
                             f"timm NaFlexVit image tower (vision_cfg.timm_model_name); this model config has none")
        cfg["vision_cfg"]["timm_model_name"] = any_patch_size(tower)
    if patch_dropout is not None:
        cfg["vision_cfg"]["patch_dropout"] = patch_dropout
    if drop_path is not None:
        cfg["vision_cfg"]["timm_drop_path"] = drop_path
    if siglip is True and cfg.get("init_logit_bias") is None:
        cfg["init_logit_bias"] = -10.0
        cfg["init_logit_scale"] = math.log(10)
    elif siglip is False:
        cfg.pop("init_logit_bias", None)
        cfg.pop("init_logit_scale", None)
    cfg.pop("custom_text", None)  # the text tower is CLIP's own
    return cfg


# A CoCa small enough for CPU tests: dense 32x32 images (open_clip's CoCa needs its own ViT's patch
# tokens; neither open_clip 3.3.0 nor upstream main gives a timm NaFlexVit tower those).
COCA_TINY = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "patch_size": 8, "layers": 2, "width": 32, "head_width": 16,
                   "attentional_pool": True, "attn_pooler_heads": 2, "attn_pooler_queries": 8,
                   "output_tokens": True},
    "text_cfg": {"context_length": 16, "vocab_size": 1024, "width": 32, "heads": 2, "layers": 2,
                 "embed_cls": True, "output_tokens": True},
    "multimodal_cfg": {"context_length": 16, "vocab_size": 1024, "width": 32, "heads": 2, "layers": 1,
                       "dim_head": 16, "attn_pooler_heads": 2},
}


class UpstreamStyleCoCa(CoCa):
    """open_clip's CoCa returning upstream main's outputs: logits at every text position, no ``labels``."""

    def forward(self, image, text=None, image_latent=None, image_embs=None):
        return super().forward(image, text, image_latent, image_embs, output_labels=False)


def fill_decoder_projection(model) -> None:
    """Initialise CoCa's ``text_decoder.text_projection`` as open_clip's ``init_parameters`` means to: open_clip
    makes it with ``torch.empty`` and never fills it (NaN at times), which no audit can reproduce."""
    projection = model.text_decoder.text_projection
    nn.init.normal_(projection, std=projection.shape[0] ** -0.5)  # shape[0] is the decoder's width


def create_coca_model(config: Optional[dict] = None, *, patch_dropout: Optional[float] = None,
                      text_dropout: float = 0.0, logit_bias: bool = False, grad_checkpointing: bool = False):
    """A tiny random open_clip ``CoCa`` (dense images) returning upstream main's CoCa outputs; ``text_dropout``
    in the text tower and decoder; ``logit_bias`` adds one (unused by CoCaLoss)."""
    cfg = copy.deepcopy(config or COCA_TINY)
    if patch_dropout is not None:
        cfg["vision_cfg"]["patch_dropout"] = patch_dropout
    model = UpstreamStyleCoCa(**cfg, init_logit_bias=-10.0 if logit_bias else None)
    fill_decoder_projection(model)
    if text_dropout:
        set_attention_dropout(model.text, text_dropout)
        set_attention_dropout(model.text_decoder, text_dropout)
    if grad_checkpointing:
        model.set_grad_checkpointing(True)
    return model
