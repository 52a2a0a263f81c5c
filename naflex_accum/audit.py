"""Audit of split invariance: accumulated gradients against one full-batch backward.

Invariant checked: for a window of examples split into microbatches, the raw
gradient of every parameter right before the optimizer step equals
``window_scale * grad(full-batch loss)``; ``logit_scale``/``logit_bias`` included,
whose ratio must be 1.0 (upstream counts them k times). With stochastic layers
the reference runs each microbatch's forward under the same seed as the step
did, so both see the same masks, then takes one loss and one backward.

Used by the tests, by ``naflex-accum table`` (the README's table) and by
``naflex-accum verify``.
"""
import math
from contextlib import nullcontext
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable, Dict, List, Sequence

import torch

from .naflex import collate_patches, concat_batches, image_to_patches
from .scales import window_loss_scale

LOGIT_PARAMS = ("logit_scale", "logit_bias")
EOT_TOKEN = 49407  # open_clip's end-of-text id: its text tower pools at the argmax token


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


def random_batch(n: int, seq_len: int, generator: torch.Generator, patch_size: int = 16,
                 context_length: int = 32) -> Dict:
    """``n`` random images of different sizes and aspect ratios (1:4 to 4:1) as one NaFlex batch."""
    items = []
    for _ in range(n):
        aspect = 4.0 ** (torch.rand((), generator=generator).item() * 2 - 1)
        side = int(32 + torch.randint(0, 96, (), generator=generator))
        h, w = max(8, int(side / math.sqrt(aspect))), max(8, int(side * math.sqrt(aspect)))
        items.append(image_to_patches(torch.rand(3, h, w, generator=generator), seq_len, patch_size))
    text = torch.randint(1, 49000, (n, context_length), generator=generator)
    lengths = torch.randint(3, context_length, (n,), generator=generator)
    text[torch.arange(n), lengths] = EOT_TOKEN
    text[torch.arange(context_length)[None] > lengths[:, None]] = 0
    return {"image": collate_patches(items, seq_len), "text": text}


def random_window(split: Sequence[int], seed: int = 0, seq_lens: Sequence[int] = (16, 24, 36)) -> List[Dict]:
    """One window: microbatch j has ``split[j]`` examples at sequence length ``seq_lens[j % len]``."""
    g = torch.Generator().manual_seed(seed)
    return [random_batch(n, seq_lens[j % len(seq_lens)], g) for j, n in enumerate(split)]


def split_window(examples: Dict, split: Sequence[int]) -> List[Dict]:
    """Split one concatenated batch into microbatches of the given sizes, in order."""
    def take(obj, lo, hi):
        return {k: take(v, lo, hi) for k, v in obj.items()} if isinstance(obj, dict) else obj[lo:hi]
    bounds = [0] + list(torch.tensor(list(split)).cumsum(0).tolist())
    return [take(examples, lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])]


def full_batch_grads(task, batches: List[Dict], seeds: Sequence[int], chunked: bool):
    """Gradients of one backward of the loss over every example of ``batches``.

    ``chunked``: run the forward per microbatch (each under its seed, as the
    step does, so stochastic layers draw the same masks), then one loss.
    """
    task.zero_grad(set_to_none=True)
    if not chunked:
        losses, _ = task(concat_batches(batches))
    else:
        outs = []
        for seed, batch in zip(seeds, batches):
            torch.manual_seed(seed)
            outs.append(task.trainable_module(**batch))
        feats = {k: torch.cat([o[k] for o in outs]) for k in outs[0] if k not in LOGIT_PARAMS}
        logits = {k: outs[-1][k] for k in LOGIT_PARAMS if k in outs[-1]}
        losses, _ = task.compute_accum_loss(feats, logits, batches)
        losses["loss"] = sum(v for k, v in losses.items() if k.endswith("_loss"))
    losses["loss"].backward()
    grads = {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
             for n, p in named_params(task)}
    task.zero_grad(set_to_none=True)
    return grads, losses["loss"].item()


def named_params(task):
    from .tasks import unwrap
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
    losses, _report, step_batch_size, _ = result
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
        if name in LOGIT_PARAMS:
            ratios[name] = (got.sum() / target.sum()).item() if target.abs().sum() > 0 else float("nan")
            continue
        denom = target.norm().item()
        err = (got - target).norm().item() / denom if denom > 0 else got.norm().item()
        if err > worst:
            worst, worst_name = err, name
    return worst, worst_name, ratios


def audit_case(step_fn: Callable, make_task: Callable, loss: str, mode: str, split: Sequence[int],
               stochastic: bool = False, reference_batch_size: int = 4, seed: int = 0,
               scaler=None, tol: float = 1e-5) -> AuditResult:
    """Compare ``step_fn`` on one split of a random window with the full-batch gradient."""
    task = make_task(loss, stochastic)
    task.train()
    batches = random_window(split, seed)
    seeds = [1000 + j for j in range(len(split))]
    reference, ref_loss = full_batch_grads(task, batches, seeds, chunked=stochastic)
    args = SimpleNamespace(accum_freq=len(split), batch_size=reference_batch_size,
                           naflex_loss_scale=mode, grad_clip_norm=None)
    grads, step_loss, n = accumulated_grads(step_fn, task, batches, seeds, args, scaler=scaler)
    scale = window_loss_scale(list(split), reference_batch_size, mode)
    err, worst, ratios = compare(grads, reference, scale)
    return AuditResult(loss, mode, tuple(split), stochastic, scale, err, worst, ratios,
                       abs(step_loss - ref_loss) / abs(ref_loss), n, tol)


def default_task_factory(loss: str, stochastic: bool):
    """The built-in tiny NaFlex CLIP/SigLIP task, seeded so every call builds the same weights."""
    from .models import create_model
    from .tasks import create_task

    torch.manual_seed(0)
    extra = dict(patch_dropout=0.5, drop_path=0.1, text_dropout=0.1) if stochastic else {}
    return create_task(create_model("naflex-tiny", siglip=(loss == "siglip"), **extra), siglip=(loss == "siglip"))


AUDIT_SPLITS = ((1, 2), (2, 1), (4, 4), (3, 5), (5, 3), (1, 2, 5), (5, 2, 1))


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
