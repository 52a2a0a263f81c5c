"""Turning images into NaFlex batches: resize to a sequence length, patchify, pad.

Invariant: a batch is ``{"patches": float [B, L, P*P*C] (channels-last per
patch), "patch_coord": int64 [B, L, 2] (y, x), "patch_valid": bool [B, L]}``
with every image's real patches first and zero padding (``patch_valid`` False)
after, so the model's masking makes padding exactly inert. Uses timm's NaFlex
transforms for the resize and patch layout.
"""
from typing import Dict, List, Sequence

import torch
from timm.data.naflex_transforms import get_image_size_for_seq, patchify_image

from .step import is_naflex_batch

IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)  # OpenAI CLIP statistics, as open_clip
IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)


def image_to_patches(img: torch.Tensor, seq_len: int, patch_size: int = 16,
                     mean=IMAGE_MEAN, std=IMAGE_STD) -> Dict[str, torch.Tensor]:
    """A float [C, H, W] image in [0, 1], resized (keeping its aspect) to at most ``seq_len`` patches."""
    import torch.nn.functional as F

    _, (h, w) = get_image_size_for_seq(tuple(img.shape[-2:]), patch_size, seq_len)
    img = F.interpolate(img[None], size=(h, w), mode="bicubic", antialias=True, align_corners=False)[0]
    img = (img.clamp(0, 1) - torch.tensor(mean)[:, None, None]) / torch.tensor(std)[:, None, None]
    patches, coord, valid = patchify_image(img, (patch_size, patch_size))
    return {"patches": patches, "patch_coord": coord, "patch_valid": valid}


def collate_patches(items: Sequence[Dict[str, torch.Tensor]], seq_len: int) -> Dict[str, torch.Tensor]:
    """Stack per-image patch dicts, zero-padding each to ``seq_len``."""
    n, dim = len(items), items[0]["patches"].shape[-1]
    patches = torch.zeros(n, seq_len, dim)
    coord = torch.zeros(n, seq_len, 2, dtype=torch.int64)
    valid = torch.zeros(n, seq_len, dtype=torch.bool)
    for i, item in enumerate(items):
        m = item["patches"].shape[0]
        if m > seq_len:
            raise ValueError(f"image {i} has {m} patches, more than the batch's sequence length {seq_len}.")
        patches[i, :m] = item["patches"]
        coord[i, :m] = item["patch_coord"]
        valid[i, :m] = item["patch_valid"]
    return {"patches": patches, "patch_coord": coord, "patch_valid": valid}


def pad_batch(batch: Dict, seq_len: int) -> Dict:
    """The same NaFlex batch with its sequence dimension zero-padded to ``seq_len``."""
    image = batch["image"]
    extra = seq_len - image["patches"].shape[1]
    if extra < 0:
        raise ValueError(f"cannot pad a batch of sequence length {image['patches'].shape[1]} down to {seq_len}.")
    padded = {
        "patches": torch.nn.functional.pad(image["patches"], (0, 0, 0, extra)),
        "patch_coord": torch.nn.functional.pad(image["patch_coord"], (0, 0, 0, extra)),
        "patch_valid": torch.nn.functional.pad(image["patch_valid"], (0, extra)),
    }
    return {**batch, "image": padded}


def concat_batches(batches: List[Dict]) -> Dict:
    """One batch holding every example of ``batches``, in order (NaFlex ones padded to the longest)."""
    if not all(is_naflex_batch(b) for b in batches):
        return {key: torch.cat([b[key] for b in batches]) for key in batches[0]}
    seq_len = max(b["image"]["patches"].shape[1] for b in batches)
    padded = [pad_batch(b, seq_len) for b in batches]
    image = {key: torch.cat([b["image"][key] for b in padded]) for key in padded[0]["image"]}
    rest = {key: torch.cat([b[key] for b in padded]) for key in padded[0] if key != "image"}
    return {"image": image, **rest}
