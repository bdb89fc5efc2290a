"""The malicious corpus: every archive that tries to write outside its destination.

Each case builds a real tar or zip whose members are laid out inside a work
directory ``work/``; the destination is ``work/dest``, the "outside" targets
are siblings in ``work/``. The test asserts the error type, that the message
names the offending member, and that ``work/`` outside ``dest`` is unchanged.
"""

from __future__ import annotations

import io
import os
import stat
import tarfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from stager.core.errors import StagerError, UnsafeArchiveMember
from stager.ops import extract
from stager.ops.base import OpContext
from stager.ops.extract import ExtractStep
from stager.wire.progress import Progress

# Every test here runs on threads and on worker processes (see conftest).
pytestmark = pytest.mark.usefixtures("pool")

# --- tar builders -------------------------------------------------------------


def _tar_file(name: str, data: bytes = b"evil") -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def _tar_link(name: str, target: str, kind: bytes) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info, None


def _tar_special(name: str, kind: bytes) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type, info.devmajor, info.devminor = kind, 1, 3
    return info, None


def _pax(info: tarfile.TarInfo, **headers: str) -> tarfile.TarInfo:
    """Only a pax header can carry a NUL byte inside a name (ustar and GNU fields end
    at the first NUL): what a hostile tar writer sends."""
    info.pax_headers = headers
    return info


def write_tar(path: Path, members: list, pax: bool = False) -> None:
    kind = tarfile.PAX_FORMAT if pax else tarfile.GNU_FORMAT
    with tarfile.open(path, "w", format=kind) as tar:
        for info, data in [_tar_file("ok/first.txt", b"fine"), *members]:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)


# --- zip builders -------------------------------------------------------------


def _zip_entry(name: str, data: bytes = b"evil", unix_mode: int | None = None):
    info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
    if unix_mode is not None:
        info.create_system = 3
        info.external_attr = unix_mode << 16
    return info, data


def write_zip(path: Path, members: list) -> None:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(*_zip_entry("ok/first.txt", b"fine"))
        for info, data in members:
            # ZipInfo keeps the name as given: what a hostile zip writer does.
            zf.writestr(info, data)


# --- the corpus ---------------------------------------------------------------


@dataclass
class Case:
    fmt: str
    members: Callable[[Path], list]  # work dir -> members
    culprit: Callable[[Path], str]  # work dir -> the member name the message must name
    error: type[StagerError] = UnsafeArchiveMember


def _same(name: str) -> Callable[[Path], str]:
    return lambda work: name


CASES = {
    "tar-absolute-path": Case(
        "tar",
        lambda w: [_tar_file(str(w / "abs_evil.txt"))],
        lambda w: str(w / "abs_evil.txt"),
    ),
    "tar-dotdot": Case("tar", lambda w: [_tar_file("../evil.txt")], _same("../evil.txt")),
    "tar-dotdot-deep": Case(
        "tar", lambda w: [_tar_file("a/b/../../../evil.txt")], _same("a/b/../../../evil.txt")
    ),
    "tar-symlink-absolute-then-file": Case(
        "tar",
        lambda w: [_tar_link("escape", str(w), tarfile.SYMTYPE), _tar_file("escape/evil.txt")],
        _same("escape"),
    ),
    "tar-symlink-dotdot-then-file": Case(
        "tar",
        lambda w: [_tar_link("escape", "..", tarfile.SYMTYPE), _tar_file("escape/evil.txt")],
        _same("escape"),
    ),
    # A file under a symlink of the archive whose target stays inside is placed where
    # GNU tar puts it (test_archive_compat); one whose target has '..' is refused.
    "tar-symlink-dotdot-inside-then-file-through-it": Case(
        "tar",
        lambda w: [_tar_link("ok/here", "../ok", tarfile.SYMTYPE), _tar_file("ok/here/evil.txt")],
        _same("ok/here/evil.txt"),
    ),
    "tar-file-then-symlink-over-its-dir": Case(
        "tar",
        lambda w: [_tar_file("sub/a.txt"), _tar_link("sub", "..", tarfile.SYMTYPE)],
        _same("sub"),
    ),
    "tar-symlink-chain-escapes-together": Case(
        "tar",
        lambda w: [
            _tar_link("b", ".", tarfile.SYMTYPE),
            _tar_link("a", "b/../outside", tarfile.SYMTYPE),
        ],
        _same("a"),
    ),
    "tar-hardlink-absolute": Case(
        "tar",
        lambda w: [_tar_link("hard", str(w / "outside.txt"), tarfile.LNKTYPE)],
        _same("hard"),
    ),
    "tar-hardlink-dotdot": Case(
        "tar",
        lambda w: [_tar_link("hard", "../outside.txt", tarfile.LNKTYPE)],
        _same("hard"),
    ),
    "tar-char-device": Case(
        "tar", lambda w: [_tar_special("null", tarfile.CHRTYPE)], _same("null")
    ),
    "tar-block-device": Case(
        "tar", lambda w: [_tar_special("disk", tarfile.BLKTYPE)], _same("disk")
    ),
    "tar-fifo": Case("tar", lambda w: [_tar_special("pipe", tarfile.FIFOTYPE)], _same("pipe")),
    # GNU tar cuts such a name at the NUL and writes another file than the archive names.
    "pax-nul-in-name": Case(
        "pax",
        lambda w: [(_pax(_tar_file("x")[0], path="ok\x00../evil.txt"), b"evil")],
        _same("ok\x00../evil.txt"),
    ),
    "pax-nul-in-symlink-target": Case(
        "pax",
        lambda w: [(_pax(_tar_link("ln", "x", tarfile.SYMTYPE)[0], linkpath="ok\x00/.."), None)],
        _same("ln"),
    ),
    "zip-absolute-path": Case(
        "zip", lambda w: [_zip_entry(str(w / "abs_evil.txt"))], lambda w: str(w / "abs_evil.txt")
    ),
    "zip-slip-dotdot": Case("zip", lambda w: [_zip_entry("../evil.txt")], _same("../evil.txt")),
    "zip-slip-backslash": Case(
        "zip", lambda w: [_zip_entry("..\\evil.txt")], _same("..\\evil.txt")
    ),
    "zip-drive-path": Case("zip", lambda w: [_zip_entry("C:/evil.txt")], _same("C:/evil.txt")),
    "zip-symlink-out-then-file": Case(
        "zip",
        lambda w: [
            _zip_entry("escape", str(w).encode(), stat.S_IFLNK | 0o777),
            _zip_entry("escape/evil.txt"),
        ],
        _same("escape"),
    ),
    "zip-symlink-inside-then-file-through-it": Case(
        "zip",
        lambda w: [
            _zip_entry("here", b"ok", stat.S_IFLNK | 0o777),
            _zip_entry("here/evil.txt"),
        ],
        _same("here/evil.txt"),
    ),
    "zip-nul-in-symlink-target": Case(
        "zip", lambda w: [_zip_entry("ln", b"ok\x00/..", stat.S_IFLNK | 0o777)], _same("ln")
    ),
    "zip-fifo": Case(
        "zip", lambda w: [_zip_entry("pipe", b"", stat.S_IFIFO | 0o644)], _same("pipe")
    ),
}


def snapshot(work: Path, dest: Path) -> dict[str, tuple]:
    """Every entry under ``work`` outside ``dest``: type, size, mtime, link target."""
    entries = {}
    for dirpath, dirnames, filenames in os.walk(work):
        if Path(dirpath) == dest or dest in Path(dirpath).parents:
            dirnames[:] = []
            continue
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            if path == str(dest):
                continue  # the destination itself may change; only what is beside it may not
            st = os.lstat(path)
            target = os.readlink(path) if stat.S_ISLNK(st.st_mode) else None
            entries[path] = (stat.S_IFMT(st.st_mode), st.st_size, st.st_mtime_ns, target)
    return entries


@pytest.mark.parametrize("case_id", list(CASES))
def test_malicious_archive_is_refused(case_id: str, tmp_path: Path):
    case = CASES[case_id]
    work = tmp_path / "work"
    dest = work / "dest"
    dest.mkdir(parents=True)
    (work / "outside.txt").write_bytes(b"precious")
    (work / "outside").mkdir()
    suffix = "zip" if case.fmt == "zip" else "tar"
    archive = tmp_path / f"evil.{suffix}"  # outside ``work``: not part of the snapshot
    if case.fmt == "zip":
        write_zip(archive, case.members(work))
    else:
        write_tar(archive, case.members(work), pax=case.fmt == "pax")

    before = snapshot(work, dest)
    ctx = OpContext(root=dest, progress=Progress(), workers=2)
    with pytest.raises(case.error) as raised:
        extract.run(ExtractStep(src=str(archive)), ctx)

    message = str(raised.value)
    assert repr(case.culprit(work)) in message or case.culprit(work) in message, message
    assert str(archive) in message
    assert snapshot(work, dest) == before
    assert (work / "outside.txt").read_bytes() == b"precious"
    for path in dest.rglob("*"):  # nothing left in dest points outside it either
        resolved = path.resolve()
        assert resolved == dest.resolve() or dest.resolve() in resolved.parents, path


@pytest.mark.parametrize("fmt", ["tar", "zip"])
def test_refused_again_on_rerun_over_partial_output(fmt: str, tmp_path: Path):
    """A restart over a partial directory holding a leftover link does not write through it."""
    work = tmp_path / "work"
    dest = work / "dest"
    dest.mkdir(parents=True)
    (dest / "sub").symlink_to(work)  # as if left by something earlier
    archive = tmp_path / f"data.{fmt}"
    if fmt == "tar":
        write_tar(archive, [_tar_file("sub/new.txt", b"data")])
    else:
        write_zip(archive, [_zip_entry("sub/new.txt", b"data")])
    before = snapshot(work, dest)
    extract.run(ExtractStep(src=str(archive)), OpContext(dest, Progress()))
    assert snapshot(work, dest) == before
    assert not (work / "new.txt").exists()
    assert (dest / "sub").is_dir() and not (dest / "sub").is_symlink()
    assert (dest / "sub/new.txt").read_bytes() == b"data"


def test_links_of_an_outer_archive_never_meet_a_running_inner_extraction(tmp_path: Path):
    """A tar of tars whose outer links escape only together, over an inner archive's folder.

    ``x.tar`` extracts into ``x/`` in parallel; the outer ``x/b -> .`` and
    ``x/sub -> b/../..`` each look harmless but resolve outside together. They may only
    be created once the inner extraction has finished, and are then refused.
    """
    work = tmp_path / "work"
    dest = work / "dest"
    dest.mkdir(parents=True)
    (work / "outside.txt").write_bytes(b"precious")
    inner = io.BytesIO()
    with tarfile.open(fileobj=inner, mode="w") as tar:
        for i in range(200):  # enough members that the inner extraction takes a while
            info, data = _tar_file(f"sub/f{i}.txt", b"inner")
            tar.addfile(info, io.BytesIO(data))
    archive = tmp_path / "outer.tar"
    write_tar(
        archive,
        [
            _tar_file("x.tar", inner.getvalue()),
            _tar_link("x/b", ".", tarfile.SYMTYPE),
            _tar_link("x/sub", "b/../..", tarfile.SYMTYPE),
        ],
    )
    before = snapshot(work, dest)
    ctx = OpContext(root=dest, progress=Progress(), workers=2)
    with pytest.raises(UnsafeArchiveMember, match="x/sub"):
        extract.run(ExtractStep(src=str(archive), nested=True), ctx)
    assert snapshot(work, dest) == before
    assert not list(work.glob("f*.txt")) and not (work / "sub").exists()


def test_a_file_over_a_folder_other_members_wrote_is_refused(tmp_path: Path):
    dest = tmp_path / "dest"
    archive = tmp_path / "dup.tar"
    write_tar(archive, [_tar_file("d/inside.txt"), _tar_file("d", b"a file named like the dir")])
    with pytest.raises(UnsafeArchiveMember, match="'d'"):
        extract.run(ExtractStep(src=str(archive)), OpContext(dest, Progress()))
