"""accum.window: outputs kept per microbatch and detached, concatenated in order, split back by recorded lengths;
an output that cannot be concatenated refused at the microbatch that shows it."""
import pytest
import torch

from naflex_accum.accum.rng import RngState
from naflex_accum.accum.window import Microbatch, Window, WindowCache, is_naflex_batch, microbatch_size
from naflex_accum.errors import StepError


def _out(n, dim=4, dtype=torch.float32):
    return {"image_features": torch.randn(n, dim, dtype=dtype, requires_grad=True),
            "text_features": torch.randn(n, dim), "logit_scale": torch.tensor(2.0, requires_grad=True)}


def test_outputs_concatenate_in_microbatch_order_detached_with_their_lengths():
    cache = WindowCache()
    outs = [_out(2), _out(3), _out(1)]
    for out in outs:
        cache.add(out)
    assert cache.added == 3 and cache.lengths("image_features") == [2, 3, 1]
    cat = cache.concatenated()
    assert set(cat) == {"image_features", "text_features"} and not cat["image_features"].requires_grad
    assert torch.equal(cat["image_features"], torch.cat([o["image_features"] for o in outs]).detach())
    assert not cache.logits["logit_scale"].requires_grad and float(cache.logits["logit_scale"]) == 2.0
    live = {"image_features": outs[1]["image_features"] * 10, "text_features": outs[1]["text_features"]}
    mixed = cache.with_live(1, live)
    assert mixed["image_features"].requires_grad and mixed["image_features"].shape == (6, 4)  # live graph kept
    assert torch.equal(mixed["image_features"][2:5], live["image_features"])
    assert torch.equal(mixed["image_features"][:2], cat["image_features"][:2])


@pytest.mark.parametrize("second, words", [
    ({"image_features": torch.zeros(2, 5), "text_features": torch.zeros(2, 4)},
     "'image_features' cannot be accumulated: microbatch 0 gave [2, 4] float32, microbatch 1 gave [2, 5] float32"),
    ({"image_features": torch.zeros(2, 4, dtype=torch.float16), "text_features": torch.zeros(2, 4)},
     "microbatch 1 gave [2, 4] float16"),
    ({"image_features": torch.zeros(2, 4)}, "'text_features' is missing from microbatch 1"),
    ({"image_features": torch.zeros(2, 4), "text_features": torch.zeros(2, 4), "extra": torch.zeros(2)},
     "'extra' appears at microbatch 1 of the window but not before"),
])
def test_what_cannot_be_concatenated_is_one_line_at_its_microbatch(second, words):
    cache = WindowCache()
    cache.add({"image_features": torch.zeros(2, 4), "text_features": torch.zeros(2, 4)})
    with pytest.raises(StepError) as info:
        cache.add(second)
    assert words in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("value, shown", [(torch.tensor(1.0), "[] float32"), (3.0, "float")])
def test_an_output_without_a_leading_dimension_is_refused_at_once(value, shown):
    with pytest.raises(StepError) as info:
        WindowCache().add({"loss_part": value})
    assert f"microbatch 0 gave {shown}; accumulation" in str(info.value)


def test_batch_kind_and_size():
    rng = RngState([], torch.get_rng_state(), [])
    window = Window([Microbatch(2, True, rng), Microbatch(5, True, rng)], "linear", 0.5)
    assert window.sizes == [2, 5]
    assert is_naflex_batch({"image": {"patches": 0}}) and not is_naflex_batch({"image": torch.zeros(1)})
    assert not is_naflex_batch([1])

    class Task:
        def batch_size(self, batch):
            return batch

    assert microbatch_size(Task(), 3, 0) == 3
    for bad in (0, True, 2.0):
        with pytest.raises(StepError, match=f"position 1 of the window has size {bad!r}"):
            microbatch_size(Task(), bad, 1)
