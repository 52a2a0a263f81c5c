"""The Pillow reference for the pipeline's images: Pillow's decode and bicubic resize, timm's patchify; no tests here."""
from typing import Dict, Sequence

import numpy as np
import torch
from PIL import Image
from timm.data import patchify_image

from naflex_accum.data.patches import IMAGE_MEAN, IMAGE_STD, collate_patches, normalize_patches, size_for_seq


def pil_to_patches(img, seq_len: int, patch_size: int = 16, flatten: bool = True) -> Dict[str, torch.Tensor]:
    """A PIL image resized (Pillow's bicubic) to at most ``seq_len`` patches, as uint8 patches."""
    h, w = size_for_seq((img.height, img.width), patch_size, seq_len)
    if img.mode in ("P", "PA") and "transparency" in img.info:
        img = img.convert("RGBA")  # what PIL asks for; converting a palette with transparency straight to RGB warns
    if img.mode != "RGB":
        img = img.convert("RGB")
    if img.size != (w, h):
        img = img.resize((w, h), Image.BICUBIC)
    hwc = torch.from_numpy(np.array(img, dtype=np.uint8))
    patches, coord, valid = patchify_image(hwc.permute(2, 0, 1), (patch_size, patch_size), flatten_patches=flatten)
    return {"patches": patches, "patch_coord": coord, "patch_valid": valid}


def collate_uint8_patches(items: Sequence[Dict[str, torch.Tensor]], seq_len: int,
                          mean=IMAGE_MEAN, std=IMAGE_STD) -> Dict[str, torch.Tensor]:
    """Stack uint8 patch dicts (``pil_to_patches``), normalised and zero-padded to ``seq_len``."""
    return normalize_patches(collate_patches(items, seq_len, torch.uint8), mean, std)
