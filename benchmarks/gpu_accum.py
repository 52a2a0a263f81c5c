"""The accumulation step at a user's size, on a GPU: time, peak CUDA memory and host syncs, against upstream's step.

Part of ``gpu_check.py`` (run it through ``benchmarks/gpu_check.sh``). The towers are upstream's, built by
its factory from the pinned snapshot (``--upstream-src``, put first on ``sys.path``): ``naflex_ViT-B-16``
(``CLIPTask``) and ``ViT-B-16-SigLIP2-naflex`` (``SigLIPTask``), random init, under bf16 autocast. For each
sequence length (256 / 576 / 784, patch 16) the microbatch is the largest that fits the token budget
(65,536 tokens: 256 / 113 / 83 samples) and a window is k of them (k = 2, 4). In one process, with warm-up
and interleaved repeats (the order rotates each repeat), it times one optimizer step of:

  full      upstream's step with accum_freq 1 over the window's samples: 1.00x
  upstream  upstream's ``_train_step_eager``, accum_freq k
  replay    ``naflex_accum.replay_step``
  default   ``naflex_accum.train_step_eager`` (cached loss)

each bracketed by ``torch.cuda.synchronize()``, and the peak of ``torch.cuda.max_memory_allocated`` over
the step (reset before it; weights, gradients and AdamW state included: the same for every variant).
Then it runs one window of each of our modes under ``torch.cuda.set_sync_debug_mode("error")``: a host
sync anywhere in the window (forwards, backwards, the loss, the optimizer step) raises, and the frame
that synced is reported; once with the tower's sync-free position embedding (any sync is then the
step's) and once as timm builds it (which syncs per sample in the position embedding, see
``sync_check``). Where a target misses it profiles one window of that variant and one of
upstream's (``torch.profiler``, the top CUDA kernels and CPU ops).

``--smoke``: the same code on the CPU at tiny sizes (the towers from upstream's factory with widths of
64), fp32, one sequence length, one repeat, no sync check (there is no device to sync with), and one profile always, so that CI
keeps every path of this file running. Writes its numbers as JSON (``--json``).
"""
import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_accum import paired, random_batch, split, steps  # noqa: E402

MODELS = {"clip": ("naflex_ViT-B-16", "CLIPTask"), "siglip": ("ViT-B-16-SigLIP2-naflex", "SigLIPTask")}
SEQ_LENS, TOKENS, KS, REPEATS, WARMUP = (256, 576, 784), 65536, (2, 4), 3, 1
SMOKE = dict(seq_lens=(16,), tokens=256, ks=(2,), repeats=1, warmup=1)
# (variant, k, at most this many times upstream's step time, or its peak memory)
TIME_TARGETS = [("default", 2, 0.90), ("default", 4, 0.95), ("replay", 2, 1.0), ("replay", 4, 1.0)]
MEMORY_LIMIT = 1.02
VARIANTS = ("upstream", "replay", "default")
TINY = {"vision_cfg": {"timm_model_kwargs": {"embed_dim": 64, "depth": 2, "num_heads": 2}},
        "text_cfg": {"width": 64, "heads": 2, "layers": 2}, "embed_dim": 64}


def model_config(name: str, smoke: bool) -> dict:
    """Upstream's config for ``name`` (its model_configs), shrunk to widths of 64 under ``--smoke``."""
    import open_clip

    cfg = json.loads(json.dumps(open_clip.get_model_config(name)))
    if cfg is None:
        raise SystemExit(f"gpu_accum: upstream has no model config {name!r}; is --upstream-src the pinned 89fb801?")
    if smoke:
        cfg["embed_dim"] = TINY["embed_dim"]
        cfg["vision_cfg"]["timm_model_kwargs"] = dict(TINY["vision_cfg"]["timm_model_kwargs"])
        cfg["text_cfg"].update(TINY["text_cfg"])
    return cfg


def build_task(loss: str, smoke: bool, device):
    import open_clip
    import open_clip.task as tasks
    import torch

    name, task_class = MODELS[loss]
    cfg = model_config(name, smoke)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        with open(os.path.join(folder, "open_clip_config.json"), "w") as f:
            json.dump({"model_cfg": cfg}, f)
        model = open_clip.create_model(f"local-dir:{folder}", force_naflex_vision=True, output_dict=True)
    task = getattr(tasks, task_class)(model, verbose=False).to(device)
    task.train()
    return task, cfg["text_cfg"]["context_length"], sum(p.numel() for p in task.parameters())


def to_device(obj, device):
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj.to(device)


class Runner:
    """One (task, seq len): windows per k, and one optimizer step of a variant, timed and memory-measured."""

    def __init__(self, task, fns, autocast, device, batch, ks, microbatch):
        import torch

        self.task, self.fns, self.autocast, self.device = task, fns, autocast, device
        self.optimizer = torch.optim.AdamW(task.parameters(), lr=1e-5)
        self.windows = {(v, k): split(batch[k], 1 if v == "full" else k)
                        for k in ks for v in ("full", *VARIANTS)}
        self.microbatch = microbatch

    def step(self, variant, k):
        window = self.windows[(variant, k)]
        kk = len(window)
        args = SimpleNamespace(accum_freq=kk, batch_size=self.microbatch, naflex_loss_scale="linear",
                               grad_clip_norm=None)
        state = ([], {}) if kk > 1 else None
        for mb in window:
            result = self.fns[variant](self.task, mb, state, self.optimizer, None, self.autocast, args)
        assert result is not None, f"{variant}: the window's last microbatch returned no step"

    def measured(self, variant, k):
        """(seconds, peak bytes) of one step."""
        import torch

        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        self.step(variant, k)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start, (torch.cuda.max_memory_allocated() if cuda else 0)


def _grid_sample(task, on: bool):
    for module in task.modules():
        if hasattr(module, "pos_embed_use_grid_sample"):
            module.pos_embed_use_grid_sample = on


def _first_sync(runner, variant, k) -> str:
    import torch

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        runner.step(variant, k)
        return "none"
    except RuntimeError as exc:
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/torch/" not in f.filename]
        where = f"{frames[-1].filename}:{frames[-1].lineno} ({frames[-1].name})" if frames else "inside torch"
        return f"synced at {where}: {str(exc).splitlines()[0]}"
    finally:
        torch.cuda.set_sync_debug_mode(0)


def sync_check(runner, k) -> dict:
    """Each of our modes' whole window under sync debug mode "error": "none", or the first frame that synced.

    ``window``: with the tower's sync-free position embedding (timm's ``pos_embed_use_grid_sample``), so
    that any sync is the step's own; ``timm-default``: as built, where timm's learned position embedding
    reads each sample's grid size from the device (``calculate_naflex_grid_sizes``), the model's choice.
    """
    out = {}
    for variant in ("replay", "default"):
        _grid_sample(runner.task, True)
        try:
            out[f"{variant}: window"] = _first_sync(runner, variant, k)
        finally:
            _grid_sample(runner.task, False)
        out[f"{variant}: timm-default"] = _first_sync(runner, variant, k)
    return out


def profile(runner, variant, k, rows=15) -> str:
    """torch.profiler tables of one window of ``variant``: CUDA kernels and CPU ops by their total time."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if runner.device.type == "cuda" else [])
    runner.step(variant, k)  # warm
    with torch_profile(activities=activities) as prof:
        runner.measured(variant, k)
    table = prof.key_averages()
    parts = []
    if runner.device.type == "cuda":
        try:  # the column's name in newer torch; older ones know only cuda_time_total
            parts.append(table.table(sort_by="device_time_total", row_limit=rows))
        except (KeyError, AttributeError, RuntimeError):
            parts.append(table.table(sort_by="cuda_time_total", row_limit=rows))
    parts.append(table.table(sort_by="cpu_time_total", row_limit=rows))
    return "\n".join(parts)


def run_setting(loss, seq_len, opts, fns, autocast, device, task, context):
    k_max = max(opts["ks"])
    microbatch = opts["tokens"] // seq_len
    full = random_batch(microbatch * k_max, seq_len, context)
    batch = {k: to_device(_first(full, microbatch * k), device) for k in opts["ks"]}
    runner = Runner(task, fns, autocast, device, batch, opts["ks"], microbatch)
    rows = [(v, k) for k in opts["ks"] for v in ("full", *VARIANTS)]
    times = {row: [] for row in rows}
    peaks = {row: 0 for row in rows}
    for r in range(opts["warmup"] + opts["repeats"]):
        shift = r % len(rows)
        for row in rows[shift:] + rows[:shift]:
            seconds, peak = runner.measured(*row)
            peaks[row] = max(peaks[row], peak)
            if r >= opts["warmup"]:
                times[row].append(seconds)
    result = {"loss": loss, "seq_len": seq_len, "microbatch": microbatch,
              "times": {f"{v}@{k}": ts for (v, k), ts in times.items()},
              "peak_bytes": {f"{v}@{k}": b for (v, k), b in peaks.items()}, "ratios": {}, "misses": []}
    for k in opts["ks"]:
        for v in VARIANTS:
            result["ratios"][f"{v}@{k}"] = {"vs_full": paired(times, (v, k), ("full", k)),
                                            "vs_upstream": paired(times, (v, k), ("upstream", k))}
    result["misses"] = misses(result, opts["ks"])
    if device.type == "cuda":
        result["sync"] = sync_check(runner, k_max)
    if result["misses"] or opts.pop("profile", False):  # --smoke: once, to keep the path running
        variant, k = (result["misses"][0]["variant"], result["misses"][0]["k"]) if result["misses"] \
            else ("default", k_max)
        result["profile"] = {}
        for v in (variant, "upstream"):
            try:  # a profiler that fails must not cost the figures measured above
                result["profile"][f"{v}@{k}"] = profile(runner, v, k)
            except Exception as exc:
                result["profile"][f"{v}@{k}"] = f"profiler failed: {type(exc).__name__}: {exc}"
    return result


def _first(batch, n):
    return {key: _first(v, n) if isinstance(v, dict) else v[:n] for key, v in batch.items()}


def misses(result, ks):
    out = []
    for variant, k, limit in TIME_TARGETS:
        if k in ks:
            ratio = result["ratios"][f"{variant}@{k}"]["vs_upstream"]
            if ratio > limit:
                out.append({"variant": variant, "k": k, "what": "time", "ratio": ratio, "limit": limit})
    for k in ks:
        for variant in ("replay", "default"):
            base = result["peak_bytes"][f"upstream@{k}"]
            ratio = result["peak_bytes"][f"{variant}@{k}"] / base if base else 1.0
            if ratio > MEMORY_LIMIT:
                out.append({"variant": variant, "k": k, "what": "memory", "ratio": ratio, "limit": MEMORY_LIMIT})
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream-src", required=True, type=Path, help="the pinned upstream's src folder")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny towers, one repeat (CI)")
    parser.add_argument("--losses", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)
    if not (args.upstream_src / "open_clip_train" / "train.py").is_file():
        parser.error(f"--upstream-src {args.upstream_src}: no open_clip_train/train.py there")
    sys.path.insert(0, str(args.upstream_src))
    import torch
    from open_clip_train.train import _train_step_eager

    opts = dict(SMOKE, profile=True) if args.smoke else dict(seq_lens=SEQ_LENS, tokens=TOKENS, ks=KS,
                                                              repeats=REPEATS, warmup=WARMUP)
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True

    def autocast():  # --smoke: fp32 (bf16 on a CPU is emulated, 5x slower, and measures nothing)
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    fns = steps(_train_step_eager)
    out = {"device": str(device), "torch": torch.__version__, "smoke": args.smoke, "opts": dict(opts),
           "precision": "bf16 autocast" if device.type == "cuda" else "fp32", "settings": []}
    for loss in args.losses:
        task, context, params = build_task(loss, args.smoke, device)
        out.setdefault("params", {})[loss] = params
        for seq_len in opts["seq_lens"]:
            started = time.perf_counter()
            result = run_setting(loss, seq_len, opts, fns, autocast, device, task, context)
            result["seconds"] = time.perf_counter() - started
            out["settings"].append(result)
            print(f"gpu_accum: {loss} seq {seq_len}: " + ", ".join(
                f"{key} {r['vs_upstream']:.3f}x" for key, r in result["ratios"].items()) +
                f" vs upstream ({result['seconds']:.0f} s)", flush=True)
            args.json.write_text(json.dumps(out, indent=1))  # what is done survives a timeout
        del task
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
