"""The fast header reader agrees with tarfile on every kind of archive, and a tar
cut short between two members is an error, not a smaller dataset."""

from __future__ import annotations

import io
import random
import subprocess
import tarfile
from pathlib import Path

import pytest

from stager.archive import tar_members
from stager.archive.tar_members import BLOCK
from stager.core.errors import CorruptArchive
from stager.ops import extract
from stager.ops.base import OpContext
from stager.ops.extract import ExtractStep
from stager.wire.progress import Progress

FIELDS = ("name", "type", "mode", "size", "mtime", "offset", "offset_data", "linkname")


def build(fmt: int, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return out.getvalue()


def info(name: str, kind: bytes = tarfile.REGTYPE, size: int = 0, **extra) -> tarfile.TarInfo:
    made = tarfile.TarInfo(name)
    made.type, made.size, made.mode, made.mtime = kind, size, 0o640, 1_700_000_000
    for key, value in extra.items():
        setattr(made, key, value)
    return made


def mixed_members() -> list[tuple[tarfile.TarInfo, bytes | None]]:
    long_dir = "/".join(["deep"] * 24)  # > 100 bytes: a ustar prefix, or a long name
    return [
        (info("top", tarfile.DIRTYPE), None),
        (info("top/a.jpg", size=3), b"abc"),
        (info("top/empty.jpg"), b""),
        (info(f"{long_dir}/file.jpg", size=700), bytes(700)),
        (info("top/" + "n" * 150 + ".jpg", size=5), b"12345"),  # too long for any prefix
        (info("top/ünïcode.jpg", size=2), b"ok"),
        (info("top/link", tarfile.SYMTYPE, linkname="a.jpg"), None),
        (info("top/hard", tarfile.LNKTYPE, linkname="top/a.jpg"), None),
        (info("top/big_mtime.jpg", size=1, mtime=2**34), b"x"),
        (info("top/sub", tarfile.DIRTYPE), None),
        (info("top/sub/last.jpg", size=1025), bytes(range(256)) * 4 + b"!"),
    ]


def read_both(data: bytes) -> tuple[list[tuple], list[tuple]]:
    expected = [
        tuple(getattr(m, f) for f in FIELDS)
        for m in tar_members.open_tar(io.BytesIO(data)).getmembers()
    ]
    headers = io.BufferedReader(io.BytesIO(data), 4096)  # type: ignore[arg-type]
    with tar_members.open_tar(headers) as tar:
        found = [tuple(getattr(m, f) for f in FIELDS) for m, _ in tar_members.members(tar, headers)]
    return expected, found


@pytest.mark.parametrize(
    "fmt",
    [tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT, tarfile.PAX_FORMAT],
    ids=["gnu", "ustar", "pax"],
)
def test_same_members_as_tarfile(fmt: int) -> None:
    members = mixed_members()
    if fmt == tarfile.USTAR_FORMAT:  # ustar has no long names and no big numbers
        members = [(i, d) for i, d in members if len(i.name) < 150 and i.mtime < 8**11]
    expected, found = read_both(build(fmt, members))
    assert found == expected
    assert len(found) == len(members)


def test_same_members_as_tarfile_for_gnu_tar(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "a" / ("x" * 120)).mkdir(parents=True)
    (tree / "a" / ("x" * 120) / "f.jpg").write_bytes(b"data")
    (tree / "a" / "g.jpg").write_bytes(bytes(5000))
    (tree / "a" / "l").symlink_to("g.jpg")
    archive = tmp_path / "t.tar"
    subprocess.run(["tar", "-cf", str(archive), "-C", str(tmp_path), "tree"], check=True)
    expected, found = read_both(archive.read_bytes())
    assert found == expected and len(found) == 6


def test_gnu_headers_have_no_name_prefix(tmp_path: Path) -> None:
    """An incremental dump (``tar -g``) fills a GNU header's atime and ctime, where a
    POSIX header keeps its name prefix: neither reader may glue them to the name."""
    tree = tmp_path / "tree"
    (tree / "d").mkdir(parents=True)
    (tree / "d" / "f.jpg").write_bytes(b"data")
    archive = tmp_path / "t.tar"
    subprocess.run(
        ["tar", "-g", str(tmp_path / "snap"), "-cf", str(archive), "-C", str(tree), "."],
        check=True,
    )
    expected, found = read_both(archive.read_bytes())
    assert found == expected
    assert [m[0] for m in found] == ["./", "./d/", "./d/f.jpg"]
    assert [m[1] for m in found] == [b"D", b"D", tarfile.REGTYPE]  # dumpdirs: folders


def test_the_fast_path_reads_plain_headers_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    data = build(tarfile.GNU_FORMAT, [(info(f"f{i}", size=1), b"x") for i in range(50)])
    calls = []
    real = tarfile.TarFile.next
    monkeypatch.setattr(tarfile.TarFile, "next", lambda self: calls.append(1) or real(self))
    headers = io.BufferedReader(io.BytesIO(data), 4096)  # type: ignore[arg-type]
    with tarfile.open(fileobj=headers, mode="r:") as tar:
        found = [m.name for m, _ in tar_members.members(tar, headers)]
    assert found == [f"f{i}" for i in range(50)]
    # tarfile read the first header when it opened, and handed it over once; no more.
    assert len(calls) == 2


def test_a_signed_checksum_header_is_left_to_tarfile() -> None:
    member = info("é" * 10, size=1)
    data = bytearray(build(tarfile.GNU_FORMAT, [(member, b"x")]))
    # Old Sun tars summed signed chars: rewrite the checksum that way.
    header = data[:512]
    signed = 256 + sum(
        b - 256 if b > 127 else b for i, b in enumerate(header) if not 148 <= i < 156
    )
    data[148:156] = b"%06o\0 " % signed
    assert tar_members.fast_header(bytes(data[:512]), 0, "utf-8", "surrogateescape") is None
    expected, found = read_both(bytes(data))
    assert found == expected and found[0][0] == "é" * 10


def extract_bytes(data: bytes, tmp_path: Path) -> None:
    archive = tmp_path / "a.tar"
    archive.write_bytes(data)
    step = ExtractStep(src=str(archive))
    extract.run(step, OpContext(root=tmp_path / "out", progress=Progress()))


def test_a_tar_cut_between_two_members_is_corrupt(tmp_path: Path) -> None:
    data = build(tarfile.GNU_FORMAT, [(info(f"f{i}.jpg", size=600), bytes(600)) for i in range(4)])
    cut = 2 * (512 + 1024)  # right after the second member's data: no end marker
    with pytest.raises(CorruptArchive, match="cut short"):
        extract_bytes(data[:cut], tmp_path)


def test_a_damaged_header_between_members_is_corrupt(tmp_path: Path) -> None:
    data = bytearray(
        build(tarfile.GNU_FORMAT, [(info(f"f{i}", size=10), bytes(10)) for i in range(3)])
    )
    data[1024 + 20] ^= 0xFF  # the second header's name: its checksum no longer matches
    with pytest.raises(CorruptArchive, match="damaged"):
        extract_bytes(bytes(data), tmp_path)


def test_a_lone_end_block_is_enough(tmp_path: Path) -> None:
    data = build(tarfile.GNU_FORMAT, [(info("f.jpg", size=3), b"abc")])
    extract_bytes(data[: 512 + 512 + 512], tmp_path)  # header, data, one zero block
    assert (tmp_path / "out" / "f.jpg").read_bytes() == b"abc"


def test_the_checksum_shortcut_agrees_with_the_byte_sum() -> None:
    """The header checksum is checked from two residues, not a Python byte sum: over
    random headers and every stored checksum near the true one (and the largest ones
    an 8-byte octal field holds), both say the same."""
    rng = random.Random(7)
    for _ in range(300):
        block = bytearray(rng.randbytes(BLOCK))
        true = 256 + sum(block[:148]) + sum(block[156:])
        for stored in (true, true + 1, true - 1, true + 65521, true + 65521 * 255, 8**8 - 1):
            assert tar_members.checksum_ok(bytes(block), stored) == (stored == true)
