import math

import pytest

from naflex_accum import window_loss_scale
from naflex_accum.accum.scales import window_is_naflex


@pytest.mark.parametrize("sizes,ref,mode,expected", [
    ([1, 2], 4, "none", 1.0),
    ([1, 2], 4, None, 1.0),
    ([1, 2], 4, "linear", 3 / 8),
    ([2, 1], 4, "linear", 3 / 8),
    ([1, 2, 5], 4, "linear", 8 / 12),
    ([1, 2, 5], 4, "sqrt", math.sqrt(8 / 12)),
    ([64], 64, "linear", 1.0),
])
def test_window_scale_values(sizes, ref, mode, expected):
    assert window_loss_scale(sizes, ref, mode) == pytest.approx(expected, rel=1e-15)


def test_window_scale_is_order_free():
    assert window_loss_scale([5, 2, 1], 3, "sqrt") == window_loss_scale([1, 2, 5], 3, "sqrt")


@pytest.mark.parametrize("ref", [0, -3, 2.5, True, None, "64"])
@pytest.mark.parametrize("mode", ["linear", "sqrt"])
def test_bad_reference_batch_size(ref, mode):
    with pytest.raises(ValueError, match=r"positive --batch-size.*" + repr(ref).replace("(", r"\(")):
        window_loss_scale([1, 2], ref, mode)


def test_empty_window():
    with pytest.raises(ValueError, match="empty window"):
        window_loss_scale([], 4, "linear")


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, None])
def test_bad_sizes(bad):
    with pytest.raises(ValueError, match=f"position 1: {bad!r}"):
        window_loss_scale([2, bad, 3], 4, "linear")


def test_unknown_mode():
    with pytest.raises(ValueError, match="'cubic'.*none, linear, sqrt"):
        window_loss_scale([1], 4, "cubic")


def test_dense_window_is_one():
    assert window_loss_scale([3, 5], 4, "linear", naflex=False) == 1.0
    assert window_loss_scale([3, 5], 4, "linear", naflex=[False, False]) == 1.0


def test_mixed_window_names_positions():
    with pytest.raises(ValueError, match=r"NaFlex at positions \[0, 2\], dense at positions \[1\]"):
        window_loss_scale([1, 2, 3], 4, "linear", naflex=[True, False, True])
    with pytest.raises(ValueError, match="mixes"):
        window_is_naflex([False, True])
