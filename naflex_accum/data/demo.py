"""Synthetic image-caption shards: one shape drawn on a plain background, and a caption saying so.

Invariant: sample i of a split is a pure function of ``(seed, split, i)`` (byte-identical output whatever the
shard size or processes) and its caption names exactly what is drawn; each split gets open_clip's
``sizes.json``. docs/data.md, "make-demo-data".
"""
import io
import json
import math
import multiprocessing as mp
import os
import random
import tarfile
from concurrent.futures import ProcessPoolExecutor
from typing import Dict, NamedTuple, Tuple

from PIL import Image, ImageDraw

from ..errors import check_int
from .schedule import derive_seed

SHAPES = ("circle", "square", "triangle", "star", "cross")
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 50), "blue": (40, 80, 235),
           "yellow": (245, 215, 30), "purple": (145, 45, 195), "orange": (245, 135, 20)}
BACKGROUNDS = {"grey": (128, 128, 128), "white": (250, 250, 250), "black": (12, 12, 12), "blue": (25, 35, 120)}
# Shape extent as a fraction of sqrt(width * height), so "large" covers a large share of the image whatever
# its aspect; capped at MAX_EXTENT of the shorter side so the position still shows in a 1:4 image.
SIZES = {"small": (0.2, 0.28), "large": (0.45, 0.6)}
MAX_EXTENT = 0.7
POSITIONS = {"top left": (0.0, 0.0), "top right": (1.0, 0.0), "centre": (0.5, 0.5),
             "bottom left": (0.0, 1.0), "bottom right": (1.0, 1.0)}  # (x, y) anchor in the free area
MIN_SIDE, MAX_SIDE, MAX_ASPECT = 32, 512, 4.0
PNG_FRACTION = 0.2


class DemoData(NamedTuple):
    """Patterns to pass as ``--train-data`` and ``--val-data`` (unpacks as a pair), and the sample counts."""
    train: str
    val: str
    num_train: int = 0
    num_val: int = 0


def caption_for(attrs: Dict[str, str]) -> str:
    where = "in the centre" if attrs["position"] == "centre" else f"at the {attrs['position']}"
    return f"a {attrs['size']} {attrs['colour']} {attrs['shape']} {where} on a {attrs['background']} background"


def _image_size(rng: random.Random) -> Tuple[int, int]:
    aspect = math.exp(rng.uniform(-math.log(MAX_ASPECT), math.log(MAX_ASPECT)))  # width / height
    stretch = max(aspect, 1.0 / aspect)
    long_side = rng.randint(max(MIN_SIDE, math.ceil(MIN_SIDE * stretch)), MAX_SIDE)
    short_side = min(long_side, max(MIN_SIDE, math.ceil(long_side / stretch)))  # ceil keeps long/short <= 4
    return (long_side, short_side) if aspect >= 1 else (short_side, long_side)


def _shape_points(shape: str, x0: float, y0: float, s: float):
    cx, cy, r = x0 + s / 2, y0 + s / 2, s / 2
    if shape == "triangle":
        return [(cx, y0), (x0 + s, y0 + s), (x0, y0 + s)]
    if shape == "star":
        return [(cx + (r if k % 2 == 0 else 0.45 * r) * math.sin(k * math.pi / 5),
                 cy - (r if k % 2 == 0 else 0.45 * r) * math.cos(k * math.pi / 5)) for k in range(10)]
    t = s / 6  # cross: a plus sign with arms a third of the extent thick
    return [(cx - t, y0), (cx + t, y0), (cx + t, cy - t), (x0 + s, cy - t), (x0 + s, cy + t), (cx + t, cy + t),
            (cx + t, y0 + s), (cx - t, y0 + s), (cx - t, cy + t), (x0, cy + t), (x0, cy - t), (cx - t, cy - t)]


def render_sample(seed: int, split: str, index: int) -> Tuple[bytes, str, Dict]:
    """(encoded image, its extension, attributes) of sample ``index`` of ``split``."""
    rng = random.Random(derive_seed("demo", seed, split, index))
    attrs = {"shape": rng.choice(SHAPES), "size": rng.choice(list(SIZES)),
             "position": rng.choice(list(POSITIONS)), "background": rng.choice(list(BACKGROUNDS))}
    attrs["colour"] = rng.choice([c for c in COLOURS if c != attrs["background"]])
    width, height = _image_size(rng)
    s = min(rng.uniform(*SIZES[attrs["size"]]) * math.sqrt(width * height), MAX_EXTENT * min(width, height))
    margin = 0.04 * min(width, height)
    ax, ay = POSITIONS[attrs["position"]]
    jitter = 0.03 * min(width, height)
    x0 = margin + ax * (width - s - 2 * margin) + rng.uniform(-jitter, jitter)
    y0 = margin + ay * (height - s - 2 * margin) + rng.uniform(-jitter, jitter)
    x0, y0 = min(max(x0, 0.0), width - s), min(max(y0, 0.0), height - s)
    img = Image.new("RGB", (width, height), BACKGROUNDS[attrs["background"]])
    draw = ImageDraw.Draw(img)
    colour = COLOURS[attrs["colour"]]
    if attrs["shape"] == "circle":
        draw.ellipse([x0, y0, x0 + s, y0 + s], fill=colour)
    elif attrs["shape"] == "square":
        draw.rectangle([x0, y0, x0 + s, y0 + s], fill=colour)
    else:
        draw.polygon(_shape_points(attrs["shape"], x0, y0, s), fill=colour)
    out = io.BytesIO()
    if rng.random() < PNG_FRACTION:
        img.save(out, format="PNG", compress_level=1)
        ext = "png"
    else:
        img.save(out, format="JPEG", quality=90)
        ext = "jpg"
    attrs.update(width=width, height=height, caption=caption_for(attrs))
    return out.getvalue(), ext, attrs


def _add(tar: tarfile.TarFile, name: str, data: bytes):
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644  # fixed metadata: same bytes every run
    tar.addfile(info, io.BytesIO(data))


def write_shard(path: str, seed: int, split: str, start: int, stop: int) -> int:
    """Samples ``start..stop-1`` of ``split`` into the tar ``path`` (written aside, then renamed into place)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(start, stop):
            data, ext, attrs = render_sample(seed, split, i)
            key = f"{split}{i:08d}"
            _add(tar, f"{key}.{ext}", data)
            _add(tar, f"{key}.txt", attrs["caption"].encode())
            _add(tar, f"{key}.json", json.dumps(attrs, sort_keys=True).encode())
    os.replace(tmp, path)
    return stop - start


def _write_split(out_dir: str, split: str, num: int, seed: int, shard_size: int, processes: int) -> str:
    folder = os.path.join(out_dir, split)
    os.makedirs(folder, exist_ok=True)
    shards = [(os.path.join(folder, f"shard-{k:06d}.tar"), seed, split, start, min(start + shard_size, num))
              for k, start in enumerate(range(0, num, shard_size))]
    if processes > 1 and len(shards) > 1:
        # fork: the children need nothing re-imported (spawn would pay for torch's import in each)
        ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else None
        with ProcessPoolExecutor(min(processes, len(shards)), mp_context=ctx) as pool:
            list(pool.map(write_shard, *zip(*shards)))
    else:
        for args in shards:
            write_shard(*args)
    with open(os.path.join(folder, "sizes.json"), "w") as f:
        json.dump({os.path.basename(a[0]): a[4] - a[3] for a in shards}, f, indent=1, sort_keys=True)
    return os.path.join(folder, f"shard-{{000000..{len(shards) - 1:06d}}}.tar")


def write_demo_data(out_dir: str, num_samples: int = 10000, val_samples: int = 1000, seed: int = 0,
                    shard_size: int = 1000, processes: int = 0) -> DemoData:
    """Write ``out_dir/train/shard-*.tar`` and ``out_dir/val/shard-*.tar`` (same-named shards overwritten);
    returns their patterns. ``processes=0`` uses up to the machine's CPU count."""
    check_int(num_samples, "--num-samples")
    check_int(shard_size, "--shard-size")
    check_int(val_samples, "--val-samples", 0)
    processes = processes or (os.cpu_count() or 1)
    train = _write_split(out_dir, "train", num_samples, seed, shard_size, processes)
    val = _write_split(out_dir, "val", val_samples, seed, shard_size, processes) if val_samples else ""
    return DemoData(train, val, num_samples, val_samples)
