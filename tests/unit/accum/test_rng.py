"""accum.rng: a replay draws what the captured forward drew, and leaves the outer stream where it was."""
import torch

from naflex_accum.accum.rng import RngState, cuda_devices_of


def test_replay_draws_the_captured_numbers_and_leaves_the_outer_stream_alone():
    torch.manual_seed(0)
    state = RngState.capture({"image": torch.zeros(2)})
    drawn = torch.rand(5)
    after = torch.rand(3)  # what the stream gives next without any replay
    torch.manual_seed(0)
    RngState.capture(None)
    torch.rand(5)
    with state.replay():
        assert torch.equal(torch.rand(5), drawn)
        torch.rand(100)
    assert torch.equal(torch.rand(3), after)


def test_a_dropout_mask_is_replayed():
    drop = torch.nn.Dropout(0.5)
    x = torch.ones(64)
    state = RngState.capture(x)
    first = drop(x)
    with state.replay():
        again = drop(x)
    assert torch.equal(first, again) and not torch.equal(drop(x), first)


def test_a_checkpointed_state_restores_through_plain_tensors():
    torch.manual_seed(1)
    saved = RngState.current().to_dict()
    expected = torch.rand(4)
    assert set(saved) == {"cpu", "cuda", "cuda_devices"} and isinstance(saved["cpu"], torch.Tensor)
    torch.rand(10)
    RngState.from_dict({"cpu": saved["cpu"]}).restore()  # a dict without CUDA entries (a CPU run's)
    assert torch.equal(torch.rand(4), expected)


def test_no_cuda_devices_in_a_cpu_batch():
    batch = {"image": {"patches": torch.zeros(1)}, "text": [torch.zeros(1), (torch.zeros(1), "x")], "n": 3}
    assert cuda_devices_of(batch) == []
    assert RngState.capture(batch).devices == [] and RngState.capture(batch).cuda == []
