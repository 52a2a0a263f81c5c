"""train/kept/checkpoint.py, train/kept/lineage.py: safe reading, damage named by the zip's CRC-32s, branches of a rolled-back
run."""

import os

import pytest
import torch

from naflex_accum.errors import UsageError
from naflex_accum.train.kept.checkpoint import load_payload, newest_loadable


def test_load_payload_refuses_code_and_garbage(tmp_path):
    import argparse

    torch.save({"epoch": 1, "args": argparse.Namespace(lr=1)}, tmp_path / "code.pt")
    with pytest.raises(UsageError, match=r"--pretrained .*code.pt: refused: opening it would import and run "
                                         r"argparse.Namespace"):
        load_payload(tmp_path / "code.pt", flag="--pretrained")
    (tmp_path / "junk.pt").write_bytes(b"PK\x03\x04" + b"\x00" * 100)  # a zip's start, then garbage
    with pytest.raises(UsageError, match="--resume .*junk.pt: incomplete: the zip directory at the end of the file "
                                         r"is missing or damaged \(a save, copy or download that did not finish\?\)"):
        load_payload(tmp_path / "junk.pt")
    from safetensors.torch import save_file
    save_file({"w": torch.ones(2)}, str(tmp_path / "w.safetensors"))
    assert torch.equal(load_payload(tmp_path / "w.safetensors", flag="--pretrained")["w"], torch.ones(2))


def test_branches_never_overwrite_an_abandoned_folder(tmp_path):
    from naflex_accum.train.kept.lineage import start_branch

    ckpts = tmp_path / "checkpoints"
    (ckpts / "abandoned-1").mkdir(parents=True)
    (ckpts / "abandoned-1" / "epoch_2.pt").write_bytes(b"kept")
    for name, step in (("epoch_1.pt", 4), ("epoch_2.pt", 8), ("step_6.pt", 6), ("step_2.pt", 2)):
        torch.save({"epoch": step // 4, "global_step": step, "step_in_epoch": 0 if "epoch" in name else step % 4 or 4,
                    "state_dict": {}, "optimizer": {}}, ckpts / name)
    branch = start_branch(ckpts, ckpts / "epoch_1.pt", (4, 1, 0))
    dest = ckpts / "abandoned-2"
    assert branch.dest == dest and [p.name for p in branch.moved] == ["epoch_2.pt", "step_6.pt"]
    assert sorted(p.name for p in dest.iterdir()) == ["epoch_2.pt", "step_6.pt"] and branch.linked is None
    assert (ckpts / "abandoned-1" / "epoch_2.pt").read_bytes() == b"kept"
    assert sorted(p.name for p in ckpts.iterdir()) == ["abandoned-1", "abandoned-2", "epoch_1.pt", "step_2.pt"]
    assert start_branch(ckpts, ckpts / "epoch_1.pt", (4, 1, 0)).moved == []  # the furthest already: nothing moves
    # back to the abandoned line's step 6: the current line goes aside whole (its step_2.pt would be pruned by
    # the new line's saves otherwise), and step 6 is linked in as the top level's start, so latest continues it
    branch = start_branch(ckpts, dest / "step_6.pt", (6, 1, 2))
    assert branch.dest == ckpts / "abandoned-3" and [p.name for p in branch.moved] == ["epoch_1.pt", "step_2.pt"]
    assert branch.linked == ckpts / "step_6.pt" and os.path.samefile(ckpts / "step_6.pt", dest / "step_6.pt")
    assert sorted(p.name for p in ckpts.iterdir()) == ["abandoned-1", "abandoned-2", "abandoned-3", "step_6.pt"]
    assert newest_loadable(ckpts)[0] == ckpts / "step_6.pt"


def test_a_branch_from_another_file_system_copies_the_checkpoint_in(tmp_path, monkeypatch):
    import errno

    from naflex_accum.train.kept import lineage

    def cross_device(src, dst):
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))
    monkeypatch.setattr(lineage.os, "link", cross_device)
    (tmp_path / "other").mkdir()
    torch.save({"epoch": 2, "global_step": 8, "state_dict": {"w": torch.ones(3)}, "optimizer": {}},
               tmp_path / "other/epoch_2.pt")
    ckpts = tmp_path / "run/checkpoints"
    ckpts.mkdir(parents=True)
    branch = lineage.start_branch(ckpts, tmp_path / "other/epoch_2.pt", (8, 2, 0))
    assert branch.moved == [] and branch.linked == ckpts / "epoch_2.pt"
    assert not os.path.samefile(ckpts / "epoch_2.pt", tmp_path / "other/epoch_2.pt")
    assert (ckpts / "epoch_2.pt").read_bytes() == (tmp_path / "other/epoch_2.pt").read_bytes()
    assert sorted(p.name for p in ckpts.iterdir()) == ["epoch_2.pt"]  # no temporary file left


def flip_values(path, key: str, count: int = 16) -> None:
    """Flip a mantissa bit in ``count`` values of tensor ``key`` inside the file's raw data (the zip still loads)."""
    tensor = torch.load(path, weights_only=True)["state_dict"][key]
    raw = bytearray(path.read_bytes())
    at = raw.find(tensor.contiguous().numpy().tobytes())
    assert at > 0
    for i in range(count):
        raw[at + 4 * i + 1] ^= 0x10
    path.write_bytes(bytes(raw))


def _old_checksum(algorithm="crc32-v1", parts=None) -> dict:
    """The ``checksum`` entry earlier versions added to every payload: {top-level key: CRC-32}."""
    return {"checksum": {"algorithm": algorithm, "parts": {"epoch": 1, "state_dict": 2, "optimizer": 3}
                         if parts is None else parts}}


@pytest.mark.parametrize("entry", [{}, _old_checksum(), _old_checksum(parts=[1, 2]), _old_checksum("crc32-v2")],
                         ids=["none", "old", "old-list", "old-other-version"])
def test_checkpoints_with_or_without_the_old_checksum_load_as_their_state(tmp_path, entry):
    """A file with the checksum entry earlier versions wrote loads; the entry is not state (never checked, dropped)."""
    from naflex_accum.train.kept.checkpoint import load_checkpoint

    state = {"epoch": 1, "state_dict": {"w": torch.ones(2)}, "optimizer": {}}
    torch.save({**state, **entry}, tmp_path / "old.pt")
    for mmap in (False, True):
        payload = load_checkpoint(tmp_path / "old.pt", mmap=mmap)
        assert sorted(payload) == sorted(state) and torch.equal(payload["state_dict"]["w"], torch.ones(2))
    assert newest_loadable(tmp_path) == (None, None)  # not a checkpoint name: the folder holds none


def test_weights_saved_through_a_compile_or_ddp_wrapper_fit_on_resume():
    """Checkpoints whose keys carry torch.compile's ``_orig_mod.`` (written before the trainer compiled in place)
    or DDP's ``module.`` fit the model they were trained as."""
    from naflex_accum.train.kept.resume import check_fits

    model = torch.nn.Linear(2, 3)
    for prefix in ("_orig_mod.", "module.", "module._orig_mod.", "_orig_mod.module."):
        saved = {prefix + key: value for key, value in model.state_dict().items()}
        assert check_fits(model, saved, "--resume x.pt", "m").keys() == model.state_dict().keys(), prefix


@pytest.mark.parametrize("flag", ["--resume", "--pretrained"])
def test_a_text_file_is_not_a_checkpoint(tmp_path, flag):
    (tmp_path / "notes.pt").write_text("hello world, these are my notes\n")
    with pytest.raises(UsageError, match=rf"{flag} .*notes.pt: not a torch checkpoint or safetensors file "
                                         rf"\(it starts with 'hello world"):
        load_payload(tmp_path / "notes.pt", flag=flag)
    (tmp_path / "empty.pt").write_bytes(b"")
    with pytest.raises(UsageError, match=rf"{flag} .*empty.pt: not a torch checkpoint or safetensors file "
                                         r"\(it is empty\)"):
        load_payload(tmp_path / "empty.pt", flag=flag)




def _payload():
    weights = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))
    return {"epoch": 3, "global_step": 12, "state_dict": {"w": weights},
            "optimizer": {"state": {}, "param_groups": [{"lr": 0.1}]}}


def _same(a: dict, b: dict) -> bool:
    return (a["epoch"], a["global_step"], a["optimizer"]) == (b["epoch"], b["global_step"], b["optimizer"]) \
        and torch.equal(a["state_dict"]["w"], b["state_dict"]["w"])


def _each_byte_flipped(path):
    """``(byte, what load_payload gave)`` for each byte of ``path`` with bit 0x10 flipped, in a copy beside it:
    a payload or a one-line ``UsageError`` that is not a refusal of code (asserted here)."""
    raw, damaged = path.read_bytes(), path.with_name("flipped.pt")
    for at in range(len(raw)):
        flipped = bytearray(raw)
        flipped[at] ^= 0x10
        damaged.write_bytes(bytes(flipped))
        try:
            yield at, load_payload(damaged)
        except UsageError as exc:
            assert "refused" not in str(exc) and len(str(exc).splitlines()) == 1, f"byte {at}: {exc}"
            yield at, exc


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # a flipped protocol byte
@pytest.mark.parametrize("old", [False, True], ids=["ours", "old-checksum"])
def test_no_flipped_bit_loads_other_numbers_or_reads_as_code(tmp_path, old):
    """Every byte of a checkpoint (ours, or one with the old checksum entry), one bit flipped: the same payload, or
    one line that is not a refusal of code."""
    from naflex_accum.train.kept.checkpoint import save_checkpoint

    path = tmp_path / "epoch_3.pt"
    save_checkpoint(path, {**_payload(), **(_old_checksum() if old else {})})
    outcomes = set()
    for at, loaded in _each_byte_flipped(path):
        if isinstance(loaded, UsageError):
            outcomes.add(str(loaded).split(": ", 2)[1])
        else:
            assert _same(loaded, _payload()) and "checksum" not in loaded, f"byte {at}: loaded other numbers"
            outcomes.add("same")
    assert {"same", "damaged"} <= outcomes


def test_a_flipped_bit_in_any_tensor_is_named_as_damage(tmp_path):
    """Each tensor's bytes are a zip member whose CRC-32 is checked on every full read (bf16 ones too)."""
    from naflex_accum.train.kept.checkpoint import save_checkpoint

    for key in ("w", "b"):
        path = tmp_path / f"{key}.pt"
        save_checkpoint(path, {**_payload(), "state_dict": {"w": torch.arange(6.0), "b": torch.ones(4).bfloat16()}})
        raw = bytearray(path.read_bytes())
        tensor = torch.load(path, weights_only=True)["state_dict"][key]
        raw[raw.find(tensor.view(torch.uint8).numpy().tobytes()) + 1] ^= 0x01
        path.write_bytes(bytes(raw))
        assert torch.load(path, weights_only=True)["epoch"] == 3  # torch's reader alone takes it
        with pytest.raises(UsageError, match=rf"^--resume \S+{key}.pt: damaged: archive/data/\d does not match the "
                                             r"CRC-32 it was written with; the file changed after it was written"):
            load_payload(path)


def test_a_flipped_pickle_byte_is_named_as_damage(tmp_path):
    torch.save(_payload(), tmp_path / "epoch_3.pt")
    raw = bytearray((tmp_path / "epoch_3.pt").read_bytes())
    at = raw.index(b"collections")  # the optimizer's OrderedDict would read as an unknown global
    raw[at + 4] ^= 0x10
    (tmp_path / "epoch_3.pt").write_bytes(bytes(raw))
    with pytest.raises(UsageError, match=r"^--resume \S+epoch_3.pt: damaged: epoch_3/data.pkl does not match the "
                                         r"CRC-32 it was written with; the file changed after it was written"):
        load_payload(tmp_path / "epoch_3.pt")


def test_a_truncated_checkpoint_is_named_incomplete_at_every_length(tmp_path):
    from naflex_accum.train.kept.checkpoint import save_checkpoint

    save_checkpoint(tmp_path / "epoch_3.pt", _payload())
    raw = (tmp_path / "epoch_3.pt").read_bytes()
    for length in range(4, len(raw), 7):
        (tmp_path / "cut.pt").write_bytes(raw[:length])
        with pytest.raises(UsageError, match=r"^--resume \S+cut.pt: incomplete: the zip directory at the end of the "
                                             r"file is missing or damaged \(a save, copy or download that did not "
                                             r"finish\?\); use another checkpoint$"):
            load_payload(tmp_path / "cut.pt")


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_a_legacy_format_file_with_a_flipped_bit_is_never_read_as_code(tmp_path):
    """torch's pre-zip format has no CRC: a flip may load other numbers (docs/long-runs.md), but a flipped global's
    name is named as a module nobody has installed, and nothing is a traceback."""
    path = tmp_path / "legacy.pt"
    torch.save(_payload(), path, _use_new_zipfile_serialization=False)
    outcomes = {str(loaded).split("flipped.pt: ", 1)[1] for _, loaded in _each_byte_flipped(path)
                if isinstance(loaded, UsageError)}
    assert "cannot read this file: its pickle names 'dorch._utils._rebuild_tensor_v2', which no installed module " \
           "provides (a damaged file, or one written by a program not installed here)" in outcomes  # 't' ^ 0x10


class _Runs:
    """Pickled as a call to os.system: what a hostile checkpoint holds."""

    def __reduce__(self):
        return os.system, ("true",)


def test_a_file_that_would_run_a_blocked_module_is_refused_as_code(tmp_path):
    torch.save({"epoch": 1, "x": _Runs()}, tmp_path / "evil.pt")
    with pytest.raises(UsageError, match=r"evil.pt: refused: opening it would import and run posix.system; only "):
        load_payload(tmp_path / "evil.pt")


def test_what_is_not_a_file_says_what_it_is(tmp_path):
    (tmp_path / "folder.pt").mkdir()
    (tmp_path / "loop.pt").symlink_to(tmp_path / "loop.pt")
    os.mkfifo(tmp_path / "fifo.pt")
    for name, what in (("folder.pt", "a folder, not a file"), ("loop.pt", "a broken or looping symbolic link"),
                       ("fifo.pt", r"not a regular file \(a device, pipe or socket\)"), ("none.pt", "no such file")):
        with pytest.raises(UsageError, match=rf"^--pretrained \S+{name}: {what}$"):
            load_payload(tmp_path / name, flag="--pretrained")
    with pytest.raises(UsageError, match=r"^--resume 'latest ': no such file$"):  # the space showed as nothing
        load_payload("latest ")


def test_a_pickle_renamed_in_the_zip_directory_is_still_checked(tmp_path):
    from naflex_accum.train.kept.checkpoint import save_checkpoint

    save_checkpoint(tmp_path / "epoch_3.pt", _payload())
    raw = bytearray((tmp_path / "epoch_3.pt").read_bytes())
    import zipfile
    pickle_name = next(n for n in zipfile.ZipFile(tmp_path / "epoch_3.pt").namelist() if n.endswith("/data.pkl"))
    name = raw.index(pickle_name.encode(), raw.index(b"PK\x01\x02"))
    raw[name + len(pickle_name) - len("ta.pkl")] ^= 0x20  # 'daTa.pkl': torch's reader still finds it
    (tmp_path / "epoch_3.pt").write_bytes(bytes(raw))
    for mmap in (False, True):  # mapped, only the pickle is checked: found whatever its name's case
        with pytest.raises(UsageError, match=r"epoch_3.pt: damaged: \S+/daTa.pkl cannot be read \(File name in "):
            load_payload(tmp_path / "epoch_3.pt", mmap=mmap)


def test_latest_skips_a_checkpoint_whose_counters_are_not_numbers(tmp_path, caplog):
    from naflex_accum.train.kept.checkpoint import save_checkpoint

    save_checkpoint(tmp_path / "epoch_1.pt", {**_payload(), "epoch": 1, "global_step": 4})
    torch.save({**_payload(), "epoch": None}, tmp_path / "epoch_2.pt")
    torch.save({**_payload(), "epoch": 3, "global_step": "nine"}, tmp_path / "epoch_3.pt")
    path, payload = newest_loadable(tmp_path)
    assert path == tmp_path / "epoch_1.pt" and payload["global_step"] == 4
    skipped = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(skipped) == 2 and all("its counters are not whole numbers" in line for line in skipped), skipped


def test_a_ctrl_c_inside_a_checkpoint_write_stays_a_keyboard_interrupt(tmp_path, monkeypatch):
    """torch's zip writer would report it as ``unexpected pos``; the file before stays, no temporary is left."""
    from naflex_accum.train.kept import checkpoint

    path = tmp_path / "epoch_latest.pt"
    checkpoint.save_checkpoint(path, _payload())
    before = path.read_bytes()
    real, calls = os.write, [0]

    def write(fd, data):
        calls[0] += 1
        if calls[0] == 3:
            raise KeyboardInterrupt  # where Ctrl-C's handler raises it: inside the bytes of the file
        return real(fd, data)
    monkeypatch.setattr(checkpoint.os, "write", write)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save_checkpoint(path, _payload())
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == [path.name]
