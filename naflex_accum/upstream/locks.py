"""The tower locks (``--lock-image``, ``--lock-text``) that upstream's ``main`` would crash on, from ``--model``'s config.

Invariant: ``refusal(args)`` names a lock setting only where upstream's ``main`` crashes on it, after creating
its run folder, for the model class its factory builds from ``--model``'s config (read with upstream's own
``get_model_config``); a config that needs the network or cannot be read is left to upstream.
docs/upstream.md, "What the runner refuses before upstream starts".
"""
from typing import Optional

import torch


def _config(model: str) -> Optional[dict]:
    """``--model``'s config as upstream's factory reads it, or None (a hub name, an unknown or unreadable one)."""
    from open_clip import get_model_config  # upstream's open_clip: imported only when a lock is checked

    if model.startswith("hf-hub:"):
        return None
    try:  # built-in names are looked up with '/' as '-', as upstream's create_model does
        cfg = get_model_config(model if model.startswith("local-dir:") else model.replace("/", "-"))
    except Exception:  # upstream's main reports it in its own words
        return None
    return cfg if isinstance(cfg, dict) else None


def _model_class(cfg: dict, args) -> str:
    """The name of the class upstream's ``create_model`` builds from ``cfg`` (its rule, both pinned commits)."""
    for key, name in (("genlip_cfg", "NaFlexGenLip"), ("genlap_cfg", "NaFlexGenLap"), ("audio_cfg", "CLAP")):
        if key in cfg:
            return name
    text = cfg.get("text_cfg") or {}
    custom = (cfg.get("custom_text") or getattr(args, "force_custom_text", False) or "hf_model_name" in text
              or text.get("text_arch") == "modern" or text.get("variable_text"))
    if not custom:
        return "CLIP"
    return "CoCa" if "multimodal_cfg" in cfg else "CustomTextCLIP"


def _resnet_locks_only_whole(unlocked: int) -> bool:
    """Whether upstream's ``ModifiedResNet.lock`` refuses ``unlocked`` groups, asked of a tiny one."""
    from open_clip.modified_resnet import ModifiedResNet  # see above

    with torch.random.fork_rng(devices=[]):  # its random init leaves the run's stream alone
        tower = ModifiedResNet(layers=[1, 1, 1, 1], output_dim=8, heads=1, image_size=32, width=8)
    try:
        tower.lock(unlocked_groups=unlocked)
    except AssertionError:
        return True
    return False


def _image(args, model: str, cfg: dict, cls) -> Optional[str]:
    if not hasattr(cls, "lock_image_tower"):
        return (f"--lock-image with --model {model}: upstream builds a {cls.__name__} from it, which has no image "
                f"tower to lock (its main raises \"--lock-image is only valid for image models\"); drop --lock-image")
    vision = cfg.get("vision_cfg") or {}
    unlocked = getattr(args, "lock_image_unlocked_groups", 0)
    naflex = getattr(args, "force_naflex_vision", False) or getattr(args, "use_naflex", False)
    resnet = not vision.get("timm_model_name") and isinstance(vision.get("layers"), (list, tuple)) and not naflex
    if resnet and unlocked and _resnet_locks_only_whole(unlocked):
        return (f"--lock-image-unlocked-groups {unlocked} with --model {model}: this upstream's ResNet image tower "
                f"locks only whole (its ModifiedResNet.lock asserts 0); use --lock-image-unlocked-groups 0")
    return None


def _text(args, model: str, cfg: dict, cls) -> Optional[str]:
    if not hasattr(cls, "lock_text_tower"):
        return (f"--lock-text with --model {model}: upstream builds a {cls.__name__} from it, which has no text tower "
                f"to lock (its main stops with an AttributeError); drop --lock-text")
    hugging_face = bool((cfg.get("text_cfg") or {}).get("hf_model_name"))  # never a CLIP: a custom text tower
    if not getattr(args, "lock_text_freeze_layer_norm", False) and not hugging_face:
        return (f"--lock-text without --lock-text-freeze-layer-norm: the text tower of --model {model} (open_clip's "
                f"own, in a {cls.__name__}) locks its LayerNorms with every other weight, and upstream asserts that "
                f"flag; add --lock-text-freeze-layer-norm")
    return None


def refusal(args) -> Optional[str]:
    """The one line refusing a lock setting upstream's ``main`` would crash on for ``--model``, or None."""
    lock_image, lock_text = getattr(args, "lock_image", False) is True, getattr(args, "lock_text", False) is True
    if not (lock_image or lock_text):
        return None
    import open_clip  # see above

    model = str(getattr(args, "model", "") or "")
    cfg = _config(model)
    cls = getattr(open_clip, _model_class(cfg, args), None) if cfg is not None else None
    if cls is None:  # a class this upstream does not have: its factory fails first
        return None
    return (lock_image and _image(args, model, cfg, cls)) or (lock_text and _text(args, model, cfg, cls)) or None
