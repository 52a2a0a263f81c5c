"""Real-photo webdataset shards for the data benchmarks, cut from the photos scikit-image ships.

The wheel of scikit-image is fetched with ``pip download`` (no install: its photos are read out of
the wheel as a zip) into ``~/.cache/naflex-accum/photos``. Each sample is a random crop of one of
its colour photos at an aspect ratio between 1:2 and 2:1, resized (Lanczos) to a long side between
384 and 1,024 px, and saved as a JPEG of quality 75 to 95 with 4:2:0 chroma, as web-crawled
image-text shards hold them; the caption names the photo. Seeded: the same shards every time.

    python benchmarks/photo_shards.py OUT_DIR [--num-samples 2000] [--shard-size 500]
    python benchmarks/photo_shards.py --decoders [--num-samples 300]   # CPU-ms per image by decoder

``--decoders`` times, on these photos with one thread, decode + bicubic-antialiased resize to the
NaFlex target at sequence lengths 64, 256 and 576 (patch 16): torchvision's full decode, Pillow's
DCT-scaled ``draft`` decode and simplejpeg's scaled decode (when installed), and how far each
scaled decode's pixels are from the full decode's (PSNR, max abs error), to choose a decoder by.
"""
import argparse
import io
import os
import random
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

CACHE = Path(os.path.expanduser("~/.cache/naflex-accum/photos"))
WHEEL = "scikit-image==0.26.0"
PHOTOS = ("astronaut", "chelsea", "coffee", "motorcycle_left", "motorcycle_right", "hubble_deep_field",
          "retina", "rocket", "ihc")


def source_photos():
    """``{name: PIL RGB image}`` of the wheel's colour photos (fetched once)."""
    from PIL import Image

    CACHE.mkdir(parents=True, exist_ok=True)
    wheels = sorted(CACHE.glob("scikit_image-*.whl"))
    if not wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(CACHE), WHEEL],
                       check=True)
        wheels = sorted(CACHE.glob("scikit_image-*.whl"))
    out = {}
    with zipfile.ZipFile(wheels[-1]) as wheel:
        for member in wheel.namelist():
            stem = Path(member).stem
            if member.startswith("skimage/data/") and stem in PHOTOS:
                out[stem] = Image.open(io.BytesIO(wheel.read(member))).convert("RGB")
    return out


def web_photo(photo, rng: random.Random) -> bytes:
    """One crop of ``photo`` as a web-crawled JPEG (see the module docstring)."""
    from PIL import Image

    aspect = 2.0 ** rng.uniform(-1.0, 1.0)  # width / height, 1:2 to 2:1
    w, h = photo.size
    cw = min(w, int(h * aspect))
    ch = min(h, int(cw / aspect))
    cw = int(ch * aspect)
    x, y = rng.randint(0, w - cw), rng.randint(0, h - ch)
    crop = photo.crop((x, y, x + cw, y + ch))
    long_side = rng.randint(384, 1024)
    scale = long_side / max(cw, ch)
    crop = crop.resize((max(1, round(cw * scale)), max(1, round(ch * scale))), Image.LANCZOS)
    buf = io.BytesIO()
    crop.save(buf, format="JPEG", quality=rng.randint(75, 95), subsampling=2)
    return buf.getvalue()


def samples(num: int, seed: int = 0):
    photos = source_photos()
    names = sorted(photos)
    rng = random.Random(seed)
    for i in range(num):
        name = names[i % len(names)]
        yield f"photo{i:08d}", web_photo(photos[name], rng), f"a photo: {name.replace('_', ' ')}"


def write_shards(out: Path, num: int, shard_size: int) -> str:
    out.mkdir(parents=True, exist_ok=True)
    shard, count = None, 0
    for i, (key, jpeg, caption) in enumerate(samples(num)):
        if i % shard_size == 0:
            if shard is not None:
                shard.close()
            shard = tarfile.open(out / f"photos-{i // shard_size:06d}.tar", "w")
            count += 1
        for ext, data in (("jpg", jpeg), ("txt", caption.encode())):
            info = tarfile.TarInfo(f"{key}.{ext}")
            info.size = len(data)
            shard.addfile(info, io.BytesIO(data))
    shard.close()
    return str(out / f"photos-{{000000..{count - 1:06d}}}.tar")


def decoders(num: int) -> None:
    import numpy as np
    import torch
    from PIL import Image
    from torchvision.io import decode_jpeg

    from torchvision.transforms import InterpolationMode
    from torchvision.transforms.v2.functional import resize_image

    from naflex_accum.data.patches import size_for_seq

    torch.set_num_threads(1)

    def resize(pixels, size):  # the pipeline's resize, to the target of the full-size image
        pixels = pixels.contiguous(memory_format=torch.channels_last) if pixels.dim() == 4 else pixels
        return resize_image(pixels, list(size), interpolation=InterpolationMode.BICUBIC, antialias=True)
    jpegs = [jpeg for _, jpeg, _ in samples(num)]
    try:
        import simplejpeg
    except ImportError:
        simplejpeg = None

    def full(data, seq):
        pixels = decode_jpeg(torch.frombuffer(data, dtype=torch.uint8))
        return resize(pixels, size_for_seq(tuple(pixels.shape[-2:]), 16, seq))

    def draft(data, seq):
        image = Image.open(io.BytesIO(data))
        th, tw = size_for_seq((image.height, image.width), 16, seq)
        image.draft("RGB", (tw, th))  # the largest DCT reduction that keeps at least the target size
        return resize(torch.from_numpy(np.asarray(image.convert("RGB"))).permute(2, 0, 1), (th, tw))

    def scaled(data, seq):
        h, w = simplejpeg.decode_jpeg_header(data)[:2]
        th, tw = size_for_seq((h, w), 16, seq)
        pixels = simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=th, min_width=tw)
        return resize(torch.from_numpy(pixels).permute(2, 0, 1), (th, tw))

    kinds = {"torchvision full": full, "Pillow draft": draft}
    if simplejpeg is not None:
        kinds["simplejpeg scaled"] = scaled
    print(f"{num} photos, median {np.median([len(j) for j in jpegs]) / 1e3:.0f} kB; CPU-ms per image, 1 thread")
    print("| seq len | " + " | ".join(kinds) + " | PSNR / max abs vs full |")
    print("|---" * (len(kinds) + 2) + "|")
    for seq in (64, 256, 576):
        times, diffs = {}, []
        for name, fn in kinds.items():
            start = time.process_time()
            outs = [fn(j, seq) for j in jpegs]
            times[name] = (time.process_time() - start) * 1e3 / num
            if name == "torchvision full":
                reference = outs
            else:
                err = [((a.float() - b.float()) ** 2).mean().item() for a, b in zip(outs, reference)]
                worst = max(int((a.int() - b.int()).abs().max()) for a, b in zip(outs, reference))
                psnr = 10 * np.log10(255 ** 2 / max(np.mean(err), 1e-12))
                diffs.append(f"{name}: {psnr:.1f} dB / {worst}")
        print(f"| {seq} | " + " | ".join(f"{times[k]:.2f}" for k in kinds) + f" | {'; '.join(diffs)} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", type=Path)
    parser.add_argument("--num-samples", type=int, default=2000)
    parser.add_argument("--shard-size", type=int, default=500)
    parser.add_argument("--decoders", action="store_true")
    args = parser.parse_args()
    if args.decoders:
        return decoders(min(args.num_samples, 300))
    if args.out is None:
        parser.error("give OUT_DIR, or --decoders")
    print(write_shards(args.out, args.num_samples, args.shard_size))


if __name__ == "__main__":
    main()
