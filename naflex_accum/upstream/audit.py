"""Audit of split invariance: accumulated gradients against one full-batch backward.

Invariant checked: each parameter's raw gradient before the optimizer step equals ``window_scale *
grad(full-batch loss)``, the logit parameters' ratio 1.0; stochastic layers run under the step's seeds. Used by
the tests, ``naflex-accum table`` and ``verify``. docs/equivalence.md, "How it is measured".
"""
import math
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..accum.contract import split_result, task_result
from ..accum.scales import window_loss_scale
from ..accum.step import total_loss
from ..accum.window import is_naflex_batch
from ..data.patches import collate_patches, image_to_patches
from ..models import create_coca_model, create_model
from ..tasks import create_task, unwrap

LOGIT_PARAMS = ("logit_scale", "logit_bias")


class GradProbe(torch.optim.Optimizer):
    """An optimizer whose ``step`` records each parameter's ``.grad`` and changes nothing."""

    def __init__(self, named_params):
        named = [(n, p) for n, p in named_params if p.requires_grad]
        self.names = {id(p): n for n, p in named}
        super().__init__([p for _, p in named], {})
        self.grads: Dict[str, torch.Tensor] = {}
        self.steps = 0

    @torch.no_grad()
    def step(self, closure=None):
        self.steps += 1
        self.grads = {self.names[id(p)]: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
                      for group in self.param_groups for p in group["params"]}


@dataclass(frozen=True)
class WindowSpec:
    """What a random audit window looks like: NaFlex or dense images, text length and vocabulary; match it to
    the model under audit (the vocabulary's last id is the end-of-text token, where CLIP's text tower pools)."""
    images: str = "naflex"  # or "dense"
    image_size: int = 32
    context_length: int = 32
    vocab_size: int = 49408
    seq_lens: Tuple[int, ...] = (16, 24, 36)  # NaFlex: microbatch j's sequence length is seq_lens[j % len]


# Per loss name: CoCa's image tower is a dense ViT (see models.COCA_TINY for the built-in one).
WINDOW_SPECS = {"coca": WindowSpec(images="dense", context_length=16, vocab_size=1024)}


def window_spec(loss: str) -> WindowSpec:
    return WINDOW_SPECS.get(loss, WindowSpec())


def random_text(n: int, generator: torch.Generator, context_length: int = 32, vocab_size: int = 49408):
    """Random token ids, each row ended by the end-of-text id (the vocabulary's last) and zero-padded."""
    eot = vocab_size - 1
    text = torch.randint(1, min(49000, eot), (n, context_length), generator=generator)
    lengths = torch.randint(3, context_length, (n,), generator=generator)
    text[torch.arange(n), lengths] = eot
    text[torch.arange(context_length)[None] > lengths[:, None]] = 0
    return text


def random_batch(n: int, seq_len: int, generator: torch.Generator, patch_size: int = 16,
                 context_length: int = 32, vocab_size: int = 49408) -> Dict:
    """``n`` random images of different sizes and aspect ratios (1:4 to 4:1) as one NaFlex batch."""
    items = []
    for _ in range(n):
        aspect = 4.0 ** (torch.rand((), generator=generator).item() * 2 - 1)
        side = int(32 + torch.randint(0, 96, (), generator=generator))
        h, w = max(8, int(side / math.sqrt(aspect))), max(8, int(side * math.sqrt(aspect)))
        items.append(image_to_patches(torch.rand(3, h, w, generator=generator), seq_len, patch_size))
    text = random_text(n, generator, context_length, vocab_size)
    return {"image": collate_patches(items, seq_len), "text": text}


def random_dense_batch(n: int, generator: torch.Generator, spec: WindowSpec) -> Dict:
    image = torch.rand(n, 3, spec.image_size, spec.image_size, generator=generator)
    return {"image": image, "text": random_text(n, generator, spec.context_length, spec.vocab_size)}


def random_window(split: Sequence[int], seed: int = 0, seq_lens: Optional[Sequence[int]] = None,
                  spec: Optional[WindowSpec] = None) -> List[Dict]:
    """One window: microbatch j has ``split[j]`` examples (NaFlex: at sequence length ``seq_lens[j % len]``)."""
    spec = spec or WindowSpec()
    g = torch.Generator().manual_seed(seed)
    if spec.images == "dense":
        return [random_dense_batch(n, g, spec) for n in split]
    seq_lens = seq_lens or spec.seq_lens
    return [random_batch(n, seq_lens[j % len(seq_lens)], g, context_length=spec.context_length,
                         vocab_size=spec.vocab_size) for j, n in enumerate(split)]


def to_device(obj, device):
    """A (nested) batch with every tensor moved to ``device``."""
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj.to(device) if isinstance(obj, torch.Tensor) else obj


def full_batch_grads(task, batches: List[Dict], seeds: Sequence[int], chunked: bool, autocast=nullcontext):
    """Gradients of one backward of the loss over every example of ``batches`` (forward under ``autocast``);
    ``chunked``: the forward per microbatch under its seed, as the step runs it, then one loss."""
    task.zero_grad(set_to_none=True)
    with autocast():
        if not chunked:
            losses, _, _ = task_result(task(concat_batches(batches)), "task(batch)", None)
        else:
            outs = []
            for seed, batch in zip(seeds, batches):
                torch.manual_seed(seed)
                outs.append(task.trainable_module(**batch))
            feats = {k: torch.cat([o[k] for o in outs]) for k in outs[0] if k not in LOGIT_PARAMS}
            logits = {k: outs[-1][k] for k in LOGIT_PARAMS if k in outs[-1]}
            losses, _, _ = task_result(task.compute_accum_loss(feats, logits, batches), "compute_accum_loss", None)
            losses["loss"] = total_loss(losses)
    losses["loss"].backward()
    grads = {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)) for n, p in named_params(task)}
    task.zero_grad(set_to_none=True)
    return grads, losses["loss"].item()


@contextmanager
def isolated_cpu():
    """A block on tiny CPU models that leaves the caller as it was: the CPU random state forked, one torch
    thread (fastest for tiny models, and ranks sharing a node do not fight), the thread count restored."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        torch.set_num_threads(threads)


def named_params(task):
    return [(n, p) for n, p in unwrap(task.trainable_module).named_parameters() if p.requires_grad]


def accumulated_grads(step_fn: Callable, task, batches: List[Dict], seeds: Sequence[int], args,
                      scaler=None, autocast=nullcontext):
    """Feed ``batches`` to ``step_fn`` as one window; return the grads its optimizer step saw."""
    probe = GradProbe(named_params(task))
    accum_state = ([], {}) if args.accum_freq > 1 else None
    result = None
    for seed, batch in zip(seeds, batches):
        torch.manual_seed(seed)
        result = step_fn(task, batch, accum_state, probe, scaler, autocast, args)
    if result is None or probe.steps != 1:
        raise RuntimeError(f"the step under audit made {probe.steps} optimizer steps for one window, not 1.")
    losses, step_batch_size = split_result(result)
    return probe.grads, float(losses["loss"]), step_batch_size


@dataclass
class AuditResult:
    loss: str
    mode: str
    split: tuple
    stochastic: bool
    window_scale: float
    tower_rel_err: float
    worst_param: str
    logit_ratios: Dict[str, float] = field(default_factory=dict)
    loss_rel_err: float = 0.0
    step_batch_size: int = 0
    tol: float = 1e-5

    @property
    def passed(self) -> bool:
        ratios_ok = all(abs(r - 1.0) <= self.tol for r in self.logit_ratios.values())
        return (self.tower_rel_err <= self.tol and ratios_ok and self.loss_rel_err <= self.tol
                and self.step_batch_size == sum(self.split))


def compare(grads, reference, scale: float):
    """Largest relative error over tower parameters, and the logit-parameter ratios."""
    worst, worst_name, ratios = 0.0, "", {}
    for name, ref in reference.items():
        target, got = ref * scale, grads[name]
        short = name.rsplit(".", 1)[-1]  # a wrapped model's logit parameters too
        if short in LOGIT_PARAMS and target.abs().sum() > 0:
            ratios[short] = (got.sum() / target.sum()).item()
            continue  # (a logit parameter the loss does not use, as CoCa's logit_bias, counts as a tower one)
        denom = target.norm().item()
        err = (got - target).norm().item() / denom if denom > 0 else got.norm().item()
        if err > worst:
            worst, worst_name = err, name
    return worst, worst_name, ratios


def audit_case(step_fn: Callable, make_task: Callable, loss: str, mode: str, split: Sequence[int],
               stochastic: bool = False, reference_batch_size: int = 4, seed: int = 0,
               scaler=None, tol: float = 1e-5, window: Optional[WindowSpec] = None,
               autocast=nullcontext, device=None) -> AuditResult:
    """Compare ``step_fn`` on one split of a random window with the full-batch gradient; ``make_task(loss,
    stochastic)`` builds a seeded task, ``loss`` picks the window unless ``window`` is given."""
    task = make_task(loss, stochastic)
    task.train()
    window = window or window_spec(loss)
    batches = random_window(split, seed, spec=window)
    if device is not None:
        task.to(device)
        batches = [to_device(b, device) for b in batches]
    seeds = [1000 + j for j in range(len(split))]
    reference, ref_loss = full_batch_grads(task, batches, seeds, chunked=stochastic, autocast=autocast)
    args = SimpleNamespace(accum_freq=len(split), batch_size=reference_batch_size,
                           naflex_loss_scale=mode, grad_clip_norm=None)
    grads, step_loss, n = accumulated_grads(step_fn, task, batches, seeds, args, scaler=scaler, autocast=autocast)
    scale = window_loss_scale(list(split), reference_batch_size, mode, naflex=window.images == "naflex")
    err, worst, ratios = compare(grads, reference, scale)
    return AuditResult(loss, mode, tuple(split), stochastic, scale, err, worst, ratios,
                       abs(step_loss - ref_loss) / abs(ref_loss), n, tol)


def default_task_factory(loss: str, stochastic: bool, **model_options):
    """The built-in tiny task, seeded: NaFlex CLIP (``naflex-tiny``) for 'clip'/'siglip', a tiny dense CoCa for
    'coca'; ``model_options`` go to the model factory."""

    torch.manual_seed(0)
    if loss == "coca":
        extra = dict(patch_dropout=0.5, text_dropout=0.1) if stochastic else {}
        return create_task(create_coca_model(**extra, **model_options), loss="coca")
    extra = dict(patch_dropout=0.5, drop_path=0.1, text_dropout=0.1) if stochastic else {}
    model = create_model("naflex-tiny", siglip=(loss == "siglip"), **extra, **model_options)
    return create_task(model, siglip=(loss == "siglip"))


AUDIT_SPLITS = ((1, 2), (2, 1), (4, 4), (3, 5), (5, 3), (1, 2, 5), (5, 2, 1))
# What `verify` and the runner's self-check audit. Uneven on purpose: an even split hides the per-replay-scale bug.
VERIFY_SPLITS = ((1, 2), (2, 1), (3, 5), (5, 2, 1))
REFERENCE_BATCH_SIZE = 4


def audit_row(step, make_task, loss: str, mode: str, split, stochastic: bool) -> AuditResult:
    """One row of ``verify``'s audit; a step (or reference) that raises gives a failed row with ``.error`` set."""
    try:
        return audit_case(step, make_task, loss, mode, split, stochastic, reference_batch_size=REFERENCE_BATCH_SIZE)
    except Exception as exc:  # the audited step failed on this install: a FAIL row that says why
        message = " ".join(str(exc).split()) or "(no message)"
        naflex = window_spec(loss).images == "naflex"
        scale = window_loss_scale(list(split), REFERENCE_BATCH_SIZE, mode, naflex=naflex)
        row = AuditResult(loss, mode, tuple(split), stochastic, scale, math.inf, "")
        row.error = f"{type(exc).__name__}: {message}"
        return row


def describe_row(row: AuditResult) -> str:
    """One failing (or passing) row in words, for one-line messages."""
    head = f"{row.loss} {row.mode} {list(row.split)} {'with' if row.stochastic else 'without'} stochastic layers"
    if hasattr(row, "error"):
        return f"{head}: the step raised {row.error}"
    ratios = ", ".join(f"{k} gradient ratio {v:.6f}" for k, v in row.logit_ratios.items())
    return (f"{head}: tower gradient relative error {row.tower_rel_err:.2e} (tolerance {row.tol:.0e})"
            + (f", {ratios} (must be 1)" if ratios else ""))


def format_table(results: List[AuditResult]) -> str:
    head = f"{'loss':<7}{'mode':<8}{'split':<11}{'stoch':<7}{'scale':>7}  {'tower rel err':>13}  " \
           f"{'logit_scale':>11}  {'logit_bias':>10}  result"
    lines = [head, "-" * len(head)]
    for r in results:
        bias = r.logit_ratios.get("logit_bias")
        lines.append(
            f"{r.loss:<7}{r.mode:<8}{str(list(r.split)):<11}{('yes' if r.stochastic else 'no'):<7}"
            f"{r.window_scale:>7.4f}  {r.tower_rel_err:>13.2e}  {r.logit_ratios.get('logit_scale', float('nan')):>11.6f}  "
            f"{(f'{bias:.6f}' if bias is not None else '-'):>10}  {'PASS' if r.passed else 'FAIL'}")
    return "\n".join(lines)


def format_summary(results: List[AuditResult]) -> str:
    """One row per (loss, stochastic, mode): the worst over all splits."""
    groups: Dict[tuple, List[AuditResult]] = {}
    for r in results:
        groups.setdefault((r.loss, r.stochastic, r.mode), []).append(r)
    head = "| loss | stochastic layers | mode | splits | max tower rel. error | logit_scale ratio | logit_bias ratio | result |"
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for (loss, stoch, mode), rs in groups.items():
        def span(key):
            vals = [r.logit_ratios[key] for r in rs if key in r.logit_ratios]
            return f"{min(vals):.6f}..{max(vals):.6f}" if vals else "-"
        ok = sum(r.passed for r in rs)
        lines.append(f"| {loss} | {'yes' if stoch else 'no'} | {mode} | {len(rs)} | "
                     f"{max(r.tower_rel_err for r in rs):.2e} | {span('logit_scale')} | {span('logit_bias')} | "
                     f"{ok}/{len(rs)} PASS |")
    return "\n".join(lines)


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
