"""data.patches: patchify puts each image's patches first (row-major, channels-last), zero padding after; the
normalised batch is what a plain float computation gives, padding exactly zero."""
import pytest
import torch

from naflex_accum.data.patches import (IMAGE_MEAN, IMAGE_STD, collate_patches, normalize_patches, patch_grid,
                                       patchify_images)

P = 4


def _images():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (3, 2 * P, 3 * P), dtype=torch.uint8, generator=g),
            torch.randint(0, 256, (3, P, P), dtype=torch.uint8, generator=g)]


def _unpatchify(patches, count, width, p=P, c=3):
    """The image back from its ``count`` patches in rows of ``width`` (the inverse of the layout)."""
    rows = count // width
    grid = patches[:count].reshape(rows, width, p, p, c)
    return grid.permute(4, 0, 2, 1, 3).reshape(c, rows * p, width * p)


def test_patchify_round_trips_and_pads_with_zeros():
    images = _images()
    batch = patchify_images(images, seq_len=8, patch_size=P)
    assert batch["patches"].shape == (2, 8, P * P * 3) and batch["patches"].dtype == torch.uint8
    assert batch["patch_valid"].sum(1).tolist() == [6, 1]
    assert torch.equal(_unpatchify(batch["patches"][0], 6, 3), images[0])
    assert torch.equal(_unpatchify(batch["patches"][1], 1, 1), images[1])
    assert not batch["patches"][1, 1:].any() and not batch["patch_coord"][1, 1:].any()
    assert batch["patch_coord"][0, :6].tolist() == [[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2]]
    unflat = patchify_images(images, seq_len=8, patch_size=P, flatten=False)["patches"]
    assert unflat.shape == (2, 8, P, P, 3) and torch.equal(unflat.reshape(2, 8, -1), batch["patches"])


def test_an_image_that_does_not_fit_the_sequence_is_refused():
    with pytest.raises(ValueError, match=r"image 0 of 8x12 does not make at most 5 whole 4x4 patches"):
        patchify_images(_images()[:1], seq_len=5, patch_size=P)
    with pytest.raises(ValueError, match="whole 4x4 patches"):
        patchify_images([torch.zeros(3, 5, 4, dtype=torch.uint8)], seq_len=8, patch_size=P)


def test_patch_grid_coordinates_and_mask():
    coord, valid = patch_grid([3, 0], [2, 1], 4)
    assert valid.tolist() == [[True, True, True, False], [False] * 4]
    assert coord.tolist() == [[[0, 0], [0, 1], [1, 0], [0, 0]], [[0, 0]] * 4]


def test_normalised_batch_is_the_plain_float_formula_with_zero_padding():
    batch = patchify_images(_images(), seq_len=8, patch_size=P)
    out = normalize_patches(batch)
    mean, std = torch.tensor(IMAGE_MEAN).repeat(P * P), torch.tensor(IMAGE_STD).repeat(P * P)
    expected = (batch["patches"].float() / 255 - mean) / std * batch["patch_valid"][..., None]
    assert out["patches"].dtype == torch.float32 and torch.allclose(out["patches"], expected, atol=1e-5)
    assert (out["patches"][1, 1:] == 0).all() and out["patch_valid"] is batch["patch_valid"]
    assert normalize_patches(out) is out  # float patches pass through
    assert normalize_patches(batch, dtype=torch.bfloat16)["patches"].dtype == torch.bfloat16


def test_collate_patches_pads_and_refuses_too_many():
    item = {"patches": torch.ones(3, 6), "patch_coord": torch.ones(3, 2, dtype=torch.int64),
            "patch_valid": torch.ones(3, dtype=torch.bool)}
    out = collate_patches([item], 5)
    assert out["patches"].shape == (1, 5, 6) and out["patch_valid"].tolist() == [[True] * 3 + [False] * 2]
    assert not out["patches"][0, 3:].any()
    with pytest.raises(ValueError, match="image 0 has 3 patches, more than the batch's sequence length 2"):
        collate_patches([item], 2)
