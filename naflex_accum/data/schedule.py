"""The batch schedule: which (sequence length, batch size, patch size) each batch of an epoch has.

Invariant: a pure function of the config and ``(seed, epoch)``, so every rank and worker computes the same list;
``batch_size * seq_len <= max_tokens`` always, and sequence lengths are stratified (every epoch the same count
of each, shuffled). docs/data.md, "The schedule".
"""
import hashlib
import math
import random
from dataclasses import dataclass
from typing import Any, List, NamedTuple, Optional, Sequence

from timm.data import calculate_naflex_batch_size

from ..errors import UsageError, check_int


@dataclass
class DataConfig:
    """The training-data settings; field comments name the ``naflex-accum train`` flag."""
    train_data: str                                 # --train-data: '::'-joined braceexpand patterns / pipe: URLs
    seq_lens: Sequence[int] = (64, 144, 256)        # --naflex-seq-lens: patch-token counts
    seq_len_probs: Optional[Sequence[float]] = None  # --naflex-seq-len-probs: relative weights
    max_tokens_per_batch: int = 4096                # --naflex-max-tokens-per-batch
    batch_divisor: int = 1                          # --naflex-batch-divisor
    patch_sizes: Sequence[int] = (16,)              # --naflex-patch-sizes
    num_samples: Optional[int] = None               # --train-num-samples (global, per epoch; None: the data set)
    num_image_tokens: Optional[int] = None          # --naflex-num-train-image-tokens (global, per epoch)
    accum_freq: int = 1                             # --accum-freq: num_batches is a multiple of it
    seed: int = 0                                   # --seed
    workers: int = 2                                # --workers
    rank: int = 0
    world_size: int = 1
    sample_shuffle_size: int = 1000                 # --sample-shuffle-size: samples shuffled together, per slot
    dataset_resampled: bool = False                 # --dataset-resampled (open_clip's default: off)
    upsampling_factors: Optional[Sequence[float]] = None  # --train-data-upsampling-factors: one per '::' source
    timeout: float = 600.0                          # --data-timeout: seconds without a batch from the workers
    slots: Optional[int] = None                     # --data-slots: the global order's slots (None: world * workers)
    image_decode: str = "scaled"                    # --image-decode: "scaled" (DCT-scaled JPEGs) or "full"
    index: Optional[Any] = None                     # a ``slots.DataIndex`` made once for every rank (``data_index``)


class BatchSpec(NamedTuple):
    seq_len: int
    batch_size: int
    patch_size: int


def derive_seed(*parts) -> int:
    """A 64-bit seed from any tuple of ints/strings, stable across processes and Python versions."""
    digest = hashlib.sha256(repr(tuple(parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little")


def _int_list(values, flag: str) -> List[int]:
    if isinstance(values, int):
        values = [values]
    values = list(values or ())
    if not values:
        raise UsageError(f"{flag} needs at least one value")
    return [check_int(v, flag) for v in values]


def normalized_probs(seq_lens: Sequence[int], probs: Optional[Sequence[float]]) -> List[float]:
    if probs is None:
        return [1.0 / len(seq_lens)] * len(seq_lens)
    probs = [float(p) for p in probs]
    if len(probs) != len(seq_lens):
        raise UsageError(f"--naflex-seq-len-probs needs one weight per --naflex-seq-lens value "
                         f"({len(seq_lens)}); got {len(probs)}")
    if any(not math.isfinite(p) or p < 0 for p in probs) or sum(probs) <= 0:
        raise UsageError(f"--naflex-seq-len-probs {probs} must be non-negative with a sum above 0")
    total = sum(probs)
    return [p / total for p in probs]


def batch_size_for(seq_len: int, max_tokens: int, divisor: int) -> int:
    """``max_tokens // seq_len`` rounded down to a multiple of ``divisor`` (timm's rule); a UsageError when below 1."""
    size = calculate_naflex_batch_size(max_tokens, seq_len, divisor=divisor, rounding="floor")
    if size * seq_len > max_tokens or size % divisor:  # timm returns 1, not 0, when nothing fits
        need = seq_len * divisor
        div = f" and --naflex-batch-divisor {divisor}" if divisor > 1 else ""
        raise UsageError(f"--naflex-seq-lens {seq_len} with --naflex-max-tokens-per-batch {max_tokens}{div} "
                         f"gives a batch size of 0; raise the budget to at least {need} or drop that sequence length")
    return size


class Schedule:
    """Validated schedule parameters; ``epoch(seed, epoch)`` is the per-epoch list of BatchSpec."""

    def __init__(self, cfg: DataConfig):
        self.seq_lens = _int_list(cfg.seq_lens, "--naflex-seq-lens")
        self.max_tokens = check_int(cfg.max_tokens_per_batch, "--naflex-max-tokens-per-batch")
        self.divisor = check_int(cfg.batch_divisor, "--naflex-batch-divisor")
        self.patch_sizes = _int_list(cfg.patch_sizes, "--naflex-patch-sizes")
        self.accum_freq = check_int(cfg.accum_freq, "--accum-freq")
        self.world_size = check_int(cfg.world_size, "world_size")
        self.probs = normalized_probs(self.seq_lens, cfg.seq_len_probs)
        self.batch_sizes = [batch_size_for(s, self.max_tokens, self.divisor) for s in self.seq_lens]
        self.seed = cfg.seed

    @property
    def multi_patch(self) -> bool:
        return len(self.patch_sizes) > 1

    @property
    def window_rows(self) -> int:
        """The most rows one rank's optimizer step (``accum_freq`` batches) can have: a window's bound."""
        return max(self.batch_sizes) * self.accum_freq

    def counts(self, num_batches: int) -> List[int]:
        """Batches of each sequence length in an epoch: largest-remainder apportionment of the probs."""
        quotas = [p * num_batches for p in self.probs]
        counts = [int(math.floor(q)) for q in quotas]
        order = sorted(range(len(quotas)), key=lambda i: (counts[i] - quotas[i], i))
        for i in order[:num_batches - sum(counts)]:
            counts[i] += 1
        return counts

    def totals(self, num_batches: int):
        """(samples, token slots) one rank consumes in an epoch of ``num_batches`` batches."""
        counts = self.counts(num_batches)
        samples = sum(c * b for c, b in zip(counts, self.batch_sizes))
        tokens = sum(c * b * s for c, b, s in zip(counts, self.batch_sizes, self.seq_lens))
        return samples, tokens

    def num_batches_within(self, num_samples: Optional[int] = None, num_image_tokens: Optional[int] = None) -> int:
        """Most batches per rank (whole steps) whose global samples (or token slots) stay within the target, or 0."""
        target, which = (num_samples, 0) if num_samples is not None else (num_image_tokens, 1)
        per_batch = [b if which == 0 else b * s for b, s in zip(self.batch_sizes, self.seq_lens)]
        expected = sum(p * x for p, x in zip(self.probs, per_batch)) * self.world_size
        step = self.accum_freq
        n = step * int(target / expected / step)

        def fits(k):
            return self.totals(k)[which] * self.world_size <= target

        # Apportionment rounding can make the estimate off by a window either way; walk to the most.
        while n > 0 and not fits(n):
            n -= step
        while fits(n + step):
            n += step
        return n

    def epoch(self, epoch: int, num_batches: int, base: int = 0) -> List[BatchSpec]:
        """The batches of epoch ``epoch``; from ``base`` > 0 (a segment after a world-size change, see
        ``order``), the schedule of the rest of the epoch, with a seed of its own."""
        parts = ("schedule", self.seed, epoch) if base == 0 else ("schedule", self.seed, epoch, base)
        rng = random.Random(derive_seed(*parts))
        seq_lens = [s for s, c in zip(self.seq_lens, self.counts(num_batches)) for _ in range(c)]
        rng.shuffle(seq_lens)
        patch_sizes = [self.patch_sizes[i % len(self.patch_sizes)] for i in range(num_batches)]
        rng.shuffle(patch_sizes)
        size = dict(zip(self.seq_lens, self.batch_sizes))
        return [BatchSpec(s, size[s], p) for s, p in zip(seq_lens, patch_sizes)]
