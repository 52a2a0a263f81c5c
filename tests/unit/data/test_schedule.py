"""The batch schedule: sizes, the token budget, determinism, and its one-line errors (no data read)."""
from collections import Counter

import pytest

from naflex_accum.data import DataConfig, check_data_config
from naflex_accum.data.schedule import BatchSpec, Schedule
from naflex_accum.errors import UsageError


def plan(**kw) -> Schedule:
    return Schedule(DataConfig(train_data="unused", **kw))


@pytest.mark.parametrize("seq_lens,budget,divisor", [
    ((64, 144, 256), 4096, 1), ((64, 144, 256), 4096, 8), ((16, 36, 64), 256, 1), ((100, 333), 1000, 3),
    ((256,), 256, 1),
])
def test_batch_sizes_hold_budget_and_divisor(seq_lens, budget, divisor):
    p = plan(seq_lens=seq_lens, max_tokens_per_batch=budget, batch_divisor=divisor)
    for spec in p.epoch(0, 50):
        assert isinstance(spec, BatchSpec)
        assert spec.batch_size >= 1 and spec.batch_size % divisor == 0
        assert spec.batch_size * spec.seq_len <= budget
        assert spec.batch_size == (budget // spec.seq_len) // divisor * divisor
        assert spec.patch_size == 16


def test_schedule_is_pure_function_of_seed_and_epoch():
    # rank, world size and workers never reach the schedule: every rank and worker computes the same list
    lists = [Schedule(DataConfig(train_data="x", seed=7, rank=r, world_size=4, workers=w)).epoch(3, 40)
             for r in range(4) for w in (0, 1, 3)]
    assert all(s == lists[0] for s in lists)
    assert plan(seed=7).epoch(3, 40) == lists[0]
    assert plan(seed=7).epoch(4, 40) != lists[0]
    assert plan(seed=8).epoch(3, 40) != lists[0]


def test_every_epoch_has_the_same_mix():
    p = plan(seq_lens=(64, 144, 256), seq_len_probs=(2, 1, 1))
    mixes = [Counter(s.seq_len for s in p.epoch(e, 40)) for e in range(5)]
    assert all(m == mixes[0] for m in mixes)
    assert mixes[0] == {64: 20, 144: 10, 256: 10}
    assert p.totals(40) == (sum(s.batch_size for s in p.epoch(9, 40)),
                            sum(s.batch_size * s.seq_len for s in p.epoch(9, 40)))


def test_zero_weight_never_scheduled():
    p = plan(seq_lens=(64, 144, 256), seq_len_probs=(1, 0, 1))
    assert {s.seq_len for s in p.epoch(0, 31)} == {64, 256}


@pytest.mark.parametrize("accum", [1, 2, 3, 4])
@pytest.mark.parametrize("world", [1, 3])
def test_num_batches_whole_steps_within_the_target(accum, world):
    p = plan(accum_freq=accum, world_size=world)
    n = p.num_batches_within(num_samples=5000)
    assert n % accum == 0 and n > 0
    assert p.totals(n)[0] * world <= 5000  # never past the target: an epoch of the data set repeats nothing
    assert p.totals(n + accum)[0] * world > 5000  # what is left over is less than one step's worth
    assert p.num_batches_within(num_samples=p.totals(accum)[0] * world - 1) == 0  # not even one step


def test_num_batches_from_image_tokens():
    p = plan(seq_lens=(64, 256), max_tokens_per_batch=4096, accum_freq=2)
    n = p.num_batches_within(num_image_tokens=1_000_000)
    assert n % 2 == 0 and p.totals(n)[1] <= 1_000_000 < p.totals(n + 2)[1]


def test_patch_sizes_spread_over_batches():
    specs = plan(patch_sizes=(8, 16)).epoch(0, 20)
    assert Counter(s.patch_size for s in specs) == {8: 10, 16: 10}
    assert plan(patch_sizes=(8, 16)).multi_patch and not plan().multi_patch


def _one_line_error(match, **kw):
    with pytest.raises(UsageError, match=match) as info:
        plan(**kw)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_seq_len_above_budget_names_both_flags():
    msg = _one_line_error(r"--naflex-seq-lens 512.*--naflex-max-tokens-per-batch 256",
                          seq_lens=(64, 512), max_tokens_per_batch=256)
    assert "batch size of 0" in msg


def test_divisor_that_empties_a_batch_is_named():
    _one_line_error(r"--naflex-seq-lens 256.*--naflex-batch-divisor 8", seq_lens=(64, 256),
                    max_tokens_per_batch=1024, batch_divisor=8)


@pytest.mark.parametrize("probs,match", [
    ((1, 1), r"--naflex-seq-len-probs needs one weight per --naflex-seq-lens value \(3\); got 2"),
    ((0, 0, 0), r"--naflex-seq-len-probs .* non-negative with a sum above 0"),
    ((1, -1, 1), r"--naflex-seq-len-probs .* non-negative"),
    ((1, float("nan"), 1), r"--naflex-seq-len-probs"),
])
def test_bad_probs(probs, match):
    _one_line_error(match, seq_len_probs=probs)


@pytest.mark.parametrize("kw,match", [
    (dict(seq_lens=()), r"--naflex-seq-lens needs at least one value"),
    (dict(seq_lens=(64, 0)), r"--naflex-seq-lens must be a positive integer, got 0"),
    (dict(patch_sizes=(16, -2)), r"--naflex-patch-sizes must be a positive integer"),
    (dict(max_tokens_per_batch=0), r"--naflex-max-tokens-per-batch must be a positive integer"),
    (dict(batch_divisor=0), r"--naflex-batch-divisor"),
    (dict(accum_freq=0), r"--accum-freq"),
])
def test_bad_values(kw, match):
    _one_line_error(match, **kw)


def test_bad_epoch_targets():
    with pytest.raises(UsageError, match=r"--train-num-samples must be a positive integer"):
        check_data_config(DataConfig(train_data="unused", num_samples=0))
    with pytest.raises(UsageError, match=r"--naflex-num-train-image-tokens must be a positive integer"):
        check_data_config(DataConfig(train_data="unused", num_image_tokens=-5))
