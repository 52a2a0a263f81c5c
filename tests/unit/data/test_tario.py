"""data.tario: the plain-tar reader yields what Python's tarfile yields, skips what it must, refuses damage."""
import io
import tarfile

import pytest

from naflex_accum.data.tario import iter_tar

LONG = "d" * 150 + "/sample.jpg"  # longer than a header's 100-byte name field


def _write(fileobj, members, fmt):
    with tarfile.open(fileobj=fileobj, mode="w", format=fmt) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _tarfile_view(blob):
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r|") as tar:
        return [(m.name, tar.extractfile(m).read()) for m in tar if m.isreg()]


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_long_and_non_ascii_names_read_as_tarfile_reads_them(fmt):
    members = [("k0.jpg", b"\xff\xd8" * 300), (LONG, b"long name"), ("café/ü.txt", "ü".encode()),
               ("k1.txt", b"")]
    out = io.BytesIO()
    _write(out, members, fmt)
    blob = out.getvalue()
    got = list(iter_tar(io.BytesIO(blob)))
    assert got == _tarfile_view(blob) == members


def test_webdataset_metadata_and_folders_are_not_members():
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in [("__key__", b"meta"), ("__meta__/x.txt", b"m"), ("k.txt", b"cap")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        folder = tarfile.TarInfo("folder")
        folder.type = tarfile.DIRTYPE
        tar.addfile(folder)
        old_style = tarfile.TarInfo("old/")  # a pre-POSIX folder: a regular-file type, its name ending in '/'
        old_style.type = tarfile.AREGTYPE
        tar.addfile(old_style)
    assert list(iter_tar(io.BytesIO(out.getvalue()))) == [("k.txt", b"cap")]


def test_unwanted_members_come_without_data_and_the_rest_intact(tmp_path):
    big = bytes(range(256)) * 6000  # over a megabyte: a seekable file is seeked past, not read
    members = [("a.bin", big), ("a.txt", b"first"), ("b.bin", big[::-1]), ("b.txt", b"second")]
    path = tmp_path / "s.tar"
    with open(path, "wb") as f:
        _write(f, members, tarfile.GNU_FORMAT)
    with open(path, "rb") as f:
        got = list(iter_tar(f, want=lambda name: name.endswith(".txt")))
    assert got == [("a.bin", None), ("a.txt", b"first"), ("b.bin", None), ("b.txt", b"second")]


def test_a_file_cut_inside_a_skipped_member_is_a_read_error_after_the_earlier_members(tmp_path):
    big = b"z" * (3 << 20)
    path = tmp_path / "cut.tar"
    with open(path, "wb") as f:
        _write(f, [("a.txt", b"ok"), ("b.bin", big), ("c.txt", b"never")], tarfile.GNU_FORMAT)
    with open(path, "r+b") as f:
        f.truncate(512 * 3 + len(big) // 2)
    got = []
    with pytest.raises(tarfile.ReadError):
        with open(path, "rb") as f:
            for item in iter_tar(f, want=lambda name: name.endswith(".txt")):
                got.append(item)
    assert got == [("a.txt", b"ok")]  # the member the cut falls in is damaged, not yielded


def test_a_short_first_header_and_a_bad_number_field_are_read_errors():
    out = io.BytesIO()
    _write(out, [("a.txt", b"x")], tarfile.USTAR_FORMAT)
    blob = bytearray(out.getvalue())
    with pytest.raises(tarfile.ReadError):
        list(iter_tar(io.BytesIO(bytes(blob[:200]))))
    blob[124:136] = b"zzzzzzzzzzz\0"  # the size field, not octal (the checksum no longer matches either)
    with pytest.raises(tarfile.ReadError):
        list(iter_tar(io.BytesIO(bytes(blob))))
