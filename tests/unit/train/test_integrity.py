"""train.integrity: a sealed payload read back with any other byte or structure names the parts that changed."""
import torch

from naflex_accum.train.integrity import ALGORITHM, CHECKSUM_KEY, changed_parts, seal, sealed


def _payload():
    return {"epoch": 2, "state_dict": {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
                                       "b": torch.zeros(3, dtype=torch.bfloat16)},
            "optimizer": {"state": {0: {"step": torch.tensor(4.0)}}, "param_groups": [{"lr": 0.1}]},
            "empty": torch.zeros(0)}


def test_a_sealed_payload_is_intact_and_shares_its_tensors():
    payload = _payload()
    out = seal(payload)
    assert sealed(out) and not sealed(payload) and out[CHECKSUM_KEY]["algorithm"] == ALGORITHM
    assert out["state_dict"]["w"] is payload["state_dict"]["w"] and changed_parts(out) == []


def test_a_flipped_byte_in_any_tensor_names_its_part():
    out = seal(_payload())
    raw = out["state_dict"]["w"].view(torch.uint8).view(-1)
    raw[5] ^= 0x01  # one bit of one float
    assert changed_parts(out) == ["state_dict"]
    out = seal(_payload())
    out["state_dict"]["b"].view(torch.int16)[0] = 1  # a bf16 value: its bytes count too
    out["optimizer"]["param_groups"][0]["lr"] = 0.2
    assert changed_parts(out) == ["optimizer", "state_dict"]


def test_structure_counts_as_well_as_bytes():
    for change in (lambda p: p["state_dict"].__setitem__("w", p["state_dict"]["w"].reshape(3, 2)),
                   lambda p: p["state_dict"].__setitem__("w", p["state_dict"]["w"].double()),
                   lambda p: p["state_dict"].__setitem__("extra", torch.zeros(1)),
                   lambda p: p["optimizer"]["param_groups"].append({})):
        out = seal(_payload())
        change(out)
        assert changed_parts(out) in (["state_dict"], ["optimizer"])
    out = seal(_payload())
    out["epoch"] = 3
    out["new"] = 1
    assert changed_parts(out) == ["epoch", "new"]
    del out["optimizer"]
    assert "optimizer" in changed_parts(out)


def test_unsealed_and_other_versions_are_not_checked():
    assert changed_parts(_payload()) == []
    out = seal(_payload())
    out[CHECKSUM_KEY]["algorithm"] = "crc32-v2"
    out["epoch"] = 99
    assert changed_parts(out) == []


def test_many_empty_containers_are_not_a_bomb():
    """``()`` is one object wherever it appears: a payload holding 200,000 of them seals and verifies."""
    payload = seal({"epoch": 1, "rows": [((), [], {}) for _ in range(200_000)]})
    assert changed_parts(payload) == []
