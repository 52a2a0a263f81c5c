"""Turning images into NaFlex batches: resize to a sequence length, patchify, pad (timm's NaFlex transforms).

Invariant: a batch is ``{"patches": [B, L, P*P*C] (or [B, L, P, P, C] with several patch sizes), "patch_coord":
int64 [B, L, 2], "patch_valid": bool [B, L]}``, real patches first and zero padding after, so padding is inert.
The pipeline keeps pixels uint8 up to the device, where ``normalize_patches`` makes bit for bit the float batch
one CPU pass makes.
"""
import functools
import math
from typing import Callable, Dict, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from timm.data import patchify_image
from timm.data.naflex_transforms import get_image_size_for_seq  # not re-exported by timm.data (pyproject.toml)
from torchvision.transforms import InterpolationMode
from torchvision.transforms.v2.functional import resize_image

from .assemble import Pool

IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)  # OpenAI CLIP statistics, as open_clip
IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)


def image_to_patches(img: torch.Tensor, seq_len: int, patch_size: int = 16,
                     mean=IMAGE_MEAN, std=IMAGE_STD, flatten: bool = True) -> Dict[str, torch.Tensor]:
    """A float [C, H, W] image in [0, 1] resized to at most ``seq_len`` patches (``flatten=False``: [N, P, P, C])."""
    _, (h, w) = get_image_size_for_seq(tuple(img.shape[-2:]), patch_size, seq_len)
    img = F.interpolate(img[None], size=(h, w), mode="bicubic", antialias=True, align_corners=False)[0]
    img = (img.clamp(0, 1) - torch.tensor(mean)[:, None, None]) / torch.tensor(std)[:, None, None]
    patches, coord, valid = patchify_image(img, (patch_size, patch_size), flatten_patches=flatten)
    return {"patches": patches, "patch_coord": coord, "patch_valid": valid}


@functools.lru_cache(maxsize=1 << 16)
def size_for_seq(hw: Tuple[int, int], patch_size: int, seq_len: int) -> Tuple[int, int]:
    """(h, w), multiples of ``patch_size``, keeping the aspect of ``hw`` within ``seq_len`` patches (cached):
    timm's ``get_image_size_for_seq`` inlined, same float operations (its calls cost a fifth of a decode; tested)."""
    (h, w), p, ceil = hw, patch_size, math.ceil
    lb, rb, eps = 1e-6, 100.0, 1e-5
    while (rb - lb) >= eps:
        mid = (lb + rb) / 2.0
        if (max(p * ceil(h * mid / p), p) // p) * (max(p * ceil(w * mid / p), p) // p) <= seq_len:
            lb = mid
        else:
            rb = mid
    if lb <= eps or lb >= 100.0:  # timm raises for these (an image too large or too small)
        return tuple(get_image_size_for_seq(hw, patch_size, seq_len)[1])
    return int(max(p * ceil(h * lb / p), p)), int(max(p * ceil(w * lb / p), p))


def resize_for_seq(img: torch.Tensor, seq_len: int, patch_size: int = 16) -> torch.Tensor:
    """A uint8 ``[C, H, W]`` image resized (keeping its aspect) to at most ``seq_len`` patches: torchvision's
    uint8 antialiased bicubic, Pillow's filter to within rounding (channels-last input is fastest)."""
    h, w = size_for_seq(tuple(img.shape[-2:]), patch_size, seq_len)
    if (h, w) == tuple(img.shape[-2:]):
        return img
    return resize_image(img, [h, w], interpolation=InterpolationMode.BICUBIC, antialias=True)


@functools.lru_cache(maxsize=16)
def _normaliser(mean, std, repeat: int, device: str = "cpu") -> Tuple[torch.Tensor, torch.Tensor]:
    """(shift, scale) on ``device``, each channel's value ``repeat`` times: ``x * scale + shift`` normalises x."""
    std = torch.tensor(std, dtype=torch.float32)
    shift, scale = (-torch.tensor(mean, dtype=torch.float32) / std).repeat(repeat), (1.0 / (255.0 * std)).repeat(repeat)
    return shift.to(device), scale.to(device)


def patchify_images(images: Sequence[torch.Tensor], seq_len: int, patch_size: int = 16, flatten: bool = True,
                    alloc: Optional[Callable[[int], torch.Tensor]] = None) -> Dict[str, torch.Tensor]:
    """uint8 ``[C, h, w]`` images (sides multiples of ``patch_size``) -> one zero-padded uint8 NaFlex batch, one
    strided copy per image; ``alloc(numel)`` may supply the memory (a ``handover`` slot: nothing copied later)."""
    p, n = patch_size, len(images)
    channels = images[0].shape[0]
    shape = (n, seq_len, p * p * channels)
    patches = torch.empty(shape, dtype=torch.uint8) if alloc is None else alloc(math.prod(shape)).view(shape)
    flat = patches.numpy()
    counts, widths = zip(*(patchify_into(flat[i], img, p, i) for i, img in enumerate(images)))
    coord, valid = patch_grid(counts, widths, seq_len)
    if not flatten:
        patches = patches.view(n, seq_len, p, p, channels)
    return {"patches": patches, "patch_coord": coord, "patch_valid": valid}


def patchify_into(row, img: torch.Tensor, patch_size: int, index: int = 0) -> Tuple[int, int]:
    """Image ``img`` (uint8 ``[C, h, w]``) as patches into ``row`` (uint8 ``[seq_len, P*P*C]``), zero-padded:
    ``(patch count, grid width)``. Called right after the resize, while the image is in the cache (3x cheaper)."""
    pixels = img.numpy()  # numpy from here: its calls cost a fraction of torch's on these small arrays
    c, h, w = pixels.shape
    p = patch_size
    gh, gw = h // p, w // p
    if gh * gw > row.shape[0] or gh * p != h or gw * p != w:
        raise ValueError(f"image {index} of {h}x{w} does not make at most {row.shape[0]} whole {p}x{p} patches")
    # numpy's strided copy is several times faster than torch's for these short (P*C-byte) rows
    grid = pixels.transpose(1, 2, 0).reshape(gh, p, gw, p * c).transpose(0, 2, 1, 3)
    count = gh * gw
    np.copyto(row[:count].reshape(gh, gw, p, p * c), grid)
    row[count:] = 0  # padding: a memset of the image's tail
    return count, gw


def normalize_patches(image: Dict[str, torch.Tensor], mean=IMAGE_MEAN, std=IMAGE_STD,
                      dtype: Optional[torch.dtype] = None) -> Dict[str, torch.Tensor]:
    """A uint8 NaFlex batch as the model's normalised float one, on its device: one ``x * scale + shift`` in
    float32, padding exactly zero, bit for bit the CPU collate's. Float patches are returned as they are."""
    patches = image["patches"]
    if patches.is_floating_point():
        return image
    n, length = patches.shape[:2]
    width = math.prod(patches.shape[2:])
    # per-channel values repeated across the whole row: a broadcast over a 3-wide last dim is 10x slower
    shift, scale = _normaliser(tuple(mean), tuple(std), width // len(mean), str(patches.device))
    valid = image["patch_valid"]
    if patches.device.type == "cpu":
        out = _normalize_rows(patches.reshape(n, length, width), valid, shift, scale).view(patches.shape)
    else:  # a few kernels over the whole batch
        out = torch.empty(patches.shape, dtype=torch.float32, device=patches.device).copy_(patches)
        rows = out.view(n * length, width)
        torch.addcmul(shift, rows, scale, out=rows)
        out.masked_fill_(~valid.view(valid.shape + (1,) * (patches.dim() - 2)), 0.0)
    if dtype is not None and dtype != out.dtype:
        out = out.to(dtype)
    return {**image, "patches": out}


_host_memory = None  # the recycled float32 memory of CPU-normalised batches (``data.assemble.Pool``), made on first use


def _normalize_rows(patches: torch.Tensor, valid: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor):
    """The CPU's way: each image's rows normalised while in the cache, its padding a memset, into recycled memory
    (a fresh batch costs a page fault per 4 KB, more than the normalise)."""
    global _host_memory
    if _host_memory is None:
        _host_memory = Pool(keep=4, dtype=torch.float32)  # a trainer holds a window's batches at most
    out = _host_memory.empty(tuple(patches.shape))
    for i, count in enumerate(valid.sum(1).tolist()):
        rows = out[i, :count]
        rows.copy_(patches[i, :count])
        torch.addcmul(shift, rows, scale, out=rows)
        out[i, count:] = 0.0
    return out


def collate_images(images: Sequence[torch.Tensor], seq_len: int, patch_size: int = 16, flatten: bool = True,
                   mean=IMAGE_MEAN, std=IMAGE_STD) -> Dict[str, torch.Tensor]:
    """uint8 images -> the normalised float NaFlex batch: ``normalize_patches(patchify_images(...))``."""
    return normalize_patches(patchify_images(images, seq_len, patch_size, flatten), mean, std)


def patch_grid(counts: Sequence[int], widths: Sequence[int], seq_len: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(patch_coord, patch_valid)`` of images with ``counts[i]`` patches in rows of ``widths[i]``, padded to
    ``seq_len``: row-major (y, x) coordinates, zero where padding."""
    index = torch.arange(seq_len)
    valid = index < torch.as_tensor(counts, dtype=torch.int64)[:, None]
    grid_w = torch.as_tensor(widths, dtype=torch.int64)[:, None]
    coord = torch.stack((index // grid_w, index % grid_w), dim=-1).mul_(valid[..., None])
    return coord, valid


def collate_patches(items: Sequence[Dict[str, torch.Tensor]], seq_len: int,
                    dtype: torch.dtype = torch.float32) -> Dict[str, torch.Tensor]:
    """Stack per-image patch dicts (flat or unflattened patches), zero-padded to ``seq_len``, as ``dtype``."""
    n, shape = len(items), tuple(items[0]["patches"].shape[1:])
    patches = torch.zeros((n, seq_len) + shape, dtype=dtype)
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
