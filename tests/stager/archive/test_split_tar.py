"""A large plain tar's plain files go to GNU tars side by side (stager.archive.split_tar);
whatever the archive, the tree, the bytes counted, the progress and the errors are
those of the ordered writer alone.

Archives are generated (random trees, GNU tar's formats, duplicates appended, links,
modes the tars may not write, names the writer must judge) and each is extracted
both ways; damaged and hand-forged headers fail alike; cancel leaves no tar running.
"""

from __future__ import annotations

import hashlib
import os
import random
import stat
import subprocess
import tarfile
import time
from pathlib import Path
from typing import Any

import pytest

from stager.archive import split_tar, writer
from stager.archive.extractor import extract_archive
from stager.archive.job import Archive
from stager.archive.tar_members import BLOCK
from stager.core.errors import Cancelled, UnsafeArchiveMember
from stager.fs.seal import KnownTree
from stager.fs.sizes import sum_sizes
from stager.wire.progress import Progress
from tests.processes import children_of, children_since

MTIME = 1_600_000_000


class Ctx:
    """An op's context as the extraction sees it; cancel after ``cancel_after`` looks."""

    def __init__(self, cancel_after: int | None = None) -> None:
        self.progress = Progress()
        self.verify = "size"
        self.workers = 2
        self._looks = 0
        self._cancel_after = cancel_after

    def check_cancelled(self) -> None:
        self._looks += 1
        if self._cancel_after is not None and self._looks > self._cancel_after:
            raise Cancelled("staging was cancelled")


@pytest.fixture
def heads(monkeypatch: pytest.MonkeyPatch) -> list[split_tar.Head]:
    """Every archive is large enough for the tars, chunks are a file or two (so even a
    small archive spans both tars); the list gets each extraction's Head."""
    monkeypatch.setattr(split_tar, "SPLIT_MIN_BYTES", 0)
    monkeypatch.setattr(split_tar, "CHUNK_FILES", 2)
    monkeypatch.setattr(split_tar, "FOLDER_CHUNK_FILES", 1)
    seen: list[split_tar.Head] = []
    real = split_tar.extract_head

    def recorded(*args: Any) -> split_tar.Head:
        head = real(*args)
        seen.append(head)
        return head

    monkeypatch.setattr(split_tar, "extract_head", recorded)
    return seen


def extract(archive: Path, dest: Path, ctx: Ctx | None = None) -> tuple[int | None, Ctx]:
    ctx = ctx or Ctx()
    fd = os.open(archive, os.O_RDONLY)
    try:
        made = extract_archive(
            ctx, Archive(fd, 0, os.fstat(fd).st_size, "tar", archive.name), str(dest)
        )
    finally:
        os.close(fd)
    return made, ctx


def by_writer(archive: Path, dest: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[int | None, Ctx]:
    with monkeypatch.context() as patch:
        patch.setattr(split_tar, "SPLIT_MIN_BYTES", 1 << 62)
        return extract(archive, dest)


def outcome(archive: Path, dest: Path, run: Any) -> tuple[str, Any]:
    try:
        made, ctx = run(archive, dest)
    except Exception as exc:  # the same error either way (the op translates it later)
        return "error", f"{type(exc).__name__}: {exc}"
    snap = ctx.progress
    if isinstance(made, KnownTree):  # the tars wrote it all: what it knows is the tree
        tree = snapshot(dest)
        assert made.entries == len(tree)
        assert set(made.folders) == {name for name, entry in tree.items() if entry[0] == "dir"}
        made = made.nbytes
    return "ok", (snapshot(dest), made, sum_sizes(dest), snap.bytes_done, snap.files_done)


def both_ways(archive: Path, work: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any]:
    """The outcome of ``archive`` through the tars (into ``work/split``) and by the
    writer alone (``work/ordered``)."""
    split = outcome(archive, work / "split", extract)
    ordered = outcome(archive, work / "ordered", lambda a, d: by_writer(a, d, monkeypatch))
    return split, ordered


def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry: kind, mode, and content, size and mtime (files), target (links)."""
    out: dict[str, tuple] = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder) / name
            st = path.lstat()
            rel = str(path.relative_to(root))
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(path))
            elif stat.S_ISDIR(st.st_mode):
                # A folder the archive names gets its time; one made for it, the clock's.
                made_now = st.st_mtime > time.time() - 3600
                out[rel] = ("dir", "made now" if made_now else st.st_mtime_ns)
            else:
                data = path.read_bytes()
                out[rel] = (
                    "file",
                    oct(st.st_mode),
                    hashlib.sha256(data).hexdigest(),
                    st.st_mtime_ns,
                )
    return out


NAMES = ["a", "b c", "é", ".hidden", "x.y", "long" * 10, "-dash", "n\\back", "c:x", "a" * 60]


def random_tree(root: Path, rng: random.Random) -> Path:
    """Folders of files with random names, sizes, modes and times; maybe links."""
    root.mkdir(parents=True)
    for i in range(rng.randint(1, 4)):
        folder = root / f"{rng.choice(NAMES)}{i}"
        sub = folder / rng.choice(NAMES) if rng.random() < 0.5 else folder
        sub.mkdir(parents=True, exist_ok=True)
        for j in range(rng.randint(0, 7)):
            target = rng.choice([folder, sub]) / f"{rng.choice(NAMES)}_{j}"
            target.write_bytes(
                rng.randbytes(rng.choice([0, 1, 511, 512, 513, 3000, 70_000, 200_000]))
            )
            # Mostly modes the tars write; now and then one they leave to the writer.
            odd = rng.random() < 0.04
            target.chmod(
                rng.choice([0o600, 0o4755, 0o1644, 0o640] if odd else [0o644, 0o755, 0o444])
            )
            os.utime(target, (MTIME + j, MTIME + j))
        if rng.random() < 0.2:
            (sub / f"link{i}").symlink_to(rng.choice(["a", "../x", "/etc"]))
        if rng.random() < 0.2 and any(p.is_file() for p in folder.iterdir()):
            first = next(p for p in sorted(folder.iterdir()) if p.is_file())
            os.link(first, folder / f"hard{i}")
    for folder, dirs, _files in os.walk(root, topdown=False):
        for name in dirs:
            os.utime(Path(folder) / name, (MTIME - 5, MTIME - 5))
    return root


def gnu_tar(*args: str | Path, cwd: Path) -> None:
    # --no-unquote: names are taken as they are (a backslash is not an escape).
    subprocess.run(
        ["tar", "--no-unquote", *map(str, args)], cwd=cwd, check=True, capture_output=True
    )


def random_archive(work: Path, rng: random.Random) -> Path:
    """A tree as GNU tar archives it, in one of its formats, maybe with later copies
    of some files appended (``tar -r``)."""
    tree = random_tree(work / "tree", rng)
    archive = work / "data.tar"
    fmt = rng.choice(["gnu", "gnu", "ustar", "posix", "oldgnu"])
    top = rng.choice([".", "*"])
    names = ["."] if top == "." else sorted(os.listdir(tree))
    try:
        gnu_tar("--format", fmt, "-cf", archive, "--", *names, cwd=tree)
    except subprocess.CalledProcessError:  # ustar cannot hold some names: GNU's then
        gnu_tar("--format", "gnu", "-cf", archive, "--", *names, cwd=tree)
    files = [p for p in tree.rglob("*") if p.is_file() and not p.is_symlink()]
    if files and rng.random() < 0.3:
        again = rng.choice(files)
        again.chmod(0o644)
        again.write_bytes(b"a later copy")
        gnu_tar("-rf", archive, "--", again.relative_to(tree), cwd=tree)
    return archive


@pytest.mark.parametrize("seed", range(24))
def test_generated_archives_extract_as_the_writer_extracts_them(
    seed: int, tmp_path: Path, heads: list[split_tar.Head], monkeypatch: pytest.MonkeyPatch
) -> None:
    archive = random_archive(tmp_path, random.Random(seed))
    split, ordered = both_ways(archive, tmp_path, monkeypatch)
    assert split == ordered
    assert len(heads) == 1  # the tars were tried (a plain tar into an empty folder)


def test_the_tars_write_whole_archives_part_of_one_and_none_of_a_refused_one(
    tmp_path: Path, heads: list[split_tar.Head], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The three ends of the tars' part: the whole archive, a leading part (a link
    ends it; the writer goes on knowing the tars' folders), nothing kept (a name
    written twice fails a tar; the writer starts again from an empty folder)."""
    tree = tmp_path / "tree"
    for i in range(6):
        (tree / f"d{i}").mkdir(parents=True)
        for j in range(3):
            (tree / f"d{i}" / f"f{j}").write_bytes(b"x" * (i * 100 + j))
    whole = tmp_path / "whole.tar"
    gnu_tar("-cf", whole, ".", cwd=tree)
    part = tmp_path / "part.tar"
    (tree / "d5" / "link").symlink_to("f0")
    gnu_tar("-cf", part, "d0", "d1", "d5", "d2", cwd=tree)
    (tree / "d2" / "f1").write_bytes(b"again")
    gnu_tar("-rf", part, "d2/f1", cwd=tree)  # after the link: the writer replaces it
    refused = tmp_path / "refused.tar"
    gnu_tar("-cf", refused, "d0", "d1", cwd=tree)
    (tree / "d0" / "f1").write_bytes(b"later")
    gnu_tar("-rf", refused, "d0/f1", cwd=tree)  # a plain copy again: a tar says "exists"
    for archive in (whole, part, refused):
        split, ordered = both_ways(archive, tmp_path / archive.stem, monkeypatch)
        assert split == ordered, archive.name
    assert [(h.complete, h.files) for h in heads] == [(True, 18), (False, 8), (False, 0)]
    assert heads[1].folders == {"d0", "d1", "d5"}
    assert (tmp_path / "part/split/d2/f1").read_bytes() == b"again"
    assert (tmp_path / "refused/split/d0/f1").read_bytes() == b"later"


def plain_header(name: bytes, size: int, kind: bytes = b"0", mode: int = 0o644) -> bytearray:
    info = tarfile.TarInfo(name.decode())
    info.size, info.mtime, info.mode, info.type = size, MTIME, mode, kind
    return bytearray(info.tobuf(tarfile.GNU_FORMAT))


def rechecksum(block: bytearray) -> None:
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % sum(block[:BLOCK])


def write_tar(path: Path, *members: tuple[bytearray, bytes]) -> Path:
    with path.open("wb") as out:
        for header, data in members:
            out.write(bytes(header) + data + bytes(-len(data) % BLOCK))
        out.write(bytes(2 * BLOCK))
    return path


FORGED = {
    # GNU tar reads these numbers otherwise than Python's int(), or not at all.
    "size with a sign": lambda h: h.__setitem__(slice(124, 136), b"+0000000003\0"),
    "size with an underscore": lambda h: h.__setitem__(slice(124, 136), b"0000_000003\0"),
    "size with spaces first": lambda h: h.__setitem__(slice(124, 136), b"          3\0"),
    "a link name on a file": lambda h: h.__setitem__(slice(157, 160), b"abc"),
    "a dot-dot name": lambda h: h.__setitem__(slice(0, 8), b"../evil\0"),
    "an absolute name": lambda h: h.__setitem__(slice(0, 6), b"/evil\0"),
    "a name with a dot component": lambda h: h.__setitem__(slice(0, 8), b"a/./b\0\0\0"),
    "a folder with data": lambda h: h.__setitem__(slice(156, 157), b"5"),
    "set-uid": lambda h: h.__setitem__(slice(100, 108), b"0004755\0"),
    "unreadable by others": lambda h: h.__setitem__(slice(100, 108), b"0000640\0"),
}


@pytest.mark.parametrize("forgery", sorted(FORGED))
def test_headers_the_tars_might_read_otherwise_are_left_to_the_writer(
    forgery: str, tmp_path: Path, heads: list[split_tar.Head], monkeypatch: pytest.MonkeyPatch
) -> None:
    first = plain_header(b"first", 3)
    forged = plain_header(b"forged", 3)
    FORGED[forgery](forged)
    rechecksum(forged)
    archive = write_tar(
        tmp_path / "forged.tar", (first, b"one"), (forged, b"two"), (plain_header(b"last", 1), b"3")
    )
    split, ordered = both_ways(archive, tmp_path, monkeypatch)
    assert split == ordered
    assert heads[0].end == BLOCK * 2 and heads[0].files == 1  # the forged member: the writer's


@pytest.mark.parametrize("where", ["a name", "a size", "the checksum"])
def test_a_damaged_header_fails_as_the_writer_fails(
    where: str, tmp_path: Path, heads: list[split_tar.Head], monkeypatch: pytest.MonkeyPatch
) -> None:
    members = [(plain_header(b"f%d" % i, 600), bytes([i]) * 600) for i in range(5)]
    damaged = members[3][0]
    offset = {"a name": 1, "a size": 130, "the checksum": 150}[where]
    damaged[offset] ^= 0x01
    archive = write_tar(tmp_path / "damaged.tar", *members)
    split, ordered = both_ways(archive, tmp_path, monkeypatch)
    assert split == ordered
    assert split[0] == "error" and "damaged" in split[1]
    assert heads[0].files == 3


def test_an_archive_cut_inside_a_member_fails_as_the_writer_fails(
    tmp_path: Path, heads: list[split_tar.Head], monkeypatch: pytest.MonkeyPatch
) -> None:
    whole = write_tar(
        tmp_path / "whole.tar", *[(plain_header(b"f%d" % i, 2000), b"z" * 2000) for i in range(4)]
    )
    cut = tmp_path / "cut.tar"
    cut.write_bytes(whole.read_bytes()[: 3 * 2560 + 1000])
    split, ordered = both_ways(cut, tmp_path, monkeypatch)
    assert split == ordered and split[0] == "error"
    assert heads[0].files == 3


def test_a_folder_not_empty_and_a_tar_that_is_not_gnu_leave_it_to_the_writer(
    tmp_path: Path, heads: list[split_tar.Head], monkeypatch: pytest.MonkeyPatch
) -> None:
    archive = write_tar(tmp_path / "a.tar", (plain_header(b"f", 1), b"1"))
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "earlier").write_bytes(b"a step before")
    extract(archive, dest)
    monkeypatch.setattr(split_tar, "gnu_tar", lambda: None)
    extract(archive, tmp_path / "other")
    assert heads == []
    assert (dest / "f").read_bytes() == (tmp_path / "other/f").read_bytes() == b"1"


def test_cancel_stops_every_tar_before_it_returns(
    tmp_path: Path, heads: list[split_tar.Head]
) -> None:
    tree = tmp_path / "tree"
    for i in range(40):
        (tree / f"d{i}").mkdir(parents=True)
        for j in range(50):
            (tree / f"d{i}" / f"f{j}").write_bytes(b"x" * 700)
    archive = tmp_path / "a.tar"
    gnu_tar("-cf", archive, ".", cwd=tree)
    dest = tmp_path / "dest"
    before = children_of(os.getpid())
    with pytest.raises(Cancelled):
        extract(archive, dest, Ctx(cancel_after=3))
    assert children_since(before) == []
    written = sum(1 for _ in dest.rglob("*"))
    time.sleep(0.2)
    assert sum(1 for _ in dest.rglob("*")) == written  # nothing writes after the return
    assert written < 2040


def test_cancel_stops_an_archive_of_folders_alone(
    tmp_path: Path, heads: list[split_tar.Head]
) -> None:
    """Folders are made by the header loop, not sent to a tar: a cancel must stop them
    too, not only a send."""
    tree = tmp_path / "tree"
    for i in range(3000):
        (tree / f"d{i // 100}" / f"e{i}").mkdir(parents=True)
    archive = tmp_path / "a.tar"
    gnu_tar("-cf", archive, ".", cwd=tree)
    dest = tmp_path / "dest"
    with pytest.raises(Cancelled):
        extract(archive, dest, Ctx(cancel_after=3))
    assert sum(1 for _ in dest.rglob("*")) < 3030  # stopped before the last folder


def test_the_folder_names_the_head_keeps_are_bounded_from_the_first(
    tmp_path: Path, heads: list[split_tar.Head], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The folder names and times the tars' part keeps are held to the writer's bound
    (HELD_NAMES_BYTES) as it makes them, not only once the writer takes them over:
    with a bound of about 50 names, an archive of 3,000 folders leaves the head at 50,
    and the writer refuses the archive with its sentence. (Before, the head kept all
    3,000 names, whatever the bound.)"""
    bound = 50 * (len("d0/e0000") + writer._HELD_OVERHEAD)
    monkeypatch.setattr(split_tar, "HELD_NAMES_BYTES", bound, raising=False)
    monkeypatch.setattr(writer, "HELD_NAMES_BYTES", bound)
    tree = tmp_path / "tree"
    for i in range(3000):
        (tree / f"d{i // 100}" / f"e{i:04d}").mkdir(parents=True)
    archive = tmp_path / "a.tar"
    gnu_tar("-cf", archive, ".", cwd=tree)
    with pytest.raises(UnsafeArchiveMember, match="MiB of names"):
        extract(archive, tmp_path / "dest")
    assert heads and len(heads[0].folders) <= 50 and len(heads[0].folder_mtimes) <= 50


def test_files_are_read_only_for_all_and_folders_keep_their_times(
    tmp_path: Path, heads: list[split_tar.Head]
) -> None:
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    for mode in (0o644, 0o755, 0o444, 0o666):
        path = tree / "sub" / f"m{mode:o}"
        path.write_bytes(b"data")
        path.chmod(mode)
    os.utime(tree / "sub", (MTIME, MTIME))
    archive = tmp_path / "a.tar"
    gnu_tar("-cf", archive, "sub", cwd=tree)
    made, ctx = extract(archive, tmp_path / "dest")
    assert heads[0].complete and heads[0].files == 4
    assert made == KnownTree(16, 5, ("sub",))
    for path in (tmp_path / "dest/sub").iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o444, path
    assert (tmp_path / "dest/sub").stat().st_mtime == MTIME
    assert sum_sizes(tmp_path / "dest") == 16
    assert ctx.progress.files_done == 4
    assert ctx.progress.bytes_done == archive.stat().st_size


def test_the_folders_files_go_to_as_many_tars_as_cores(
    tmp_path: Path, heads: list[split_tar.Head], monkeypatch: pytest.MonkeyPatch
) -> None:
    tree = tmp_path / "tree"
    for i in range(4):
        (tree / f"d{i}").mkdir(parents=True)
        (tree / f"d{i}" / "f").write_bytes(b"x")
    archive = tmp_path / "a.tar"
    gnu_tar("-cf", archive, ".", cwd=tree)
    started: list[list[str]] = []
    real = split_tar.spawn

    def popen(args: list[str], **kwargs: Any) -> Any:
        started.append(args)
        return real(args, **kwargs)

    monkeypatch.setattr(split_tar, "spawn", popen)
    extract(archive, tmp_path / "dest")
    assert len(started) == 2 and all("--keep-old-files" in args for args in started)
    assert heads[0].complete and heads[0].files == 4


def test_the_headers_read_stay_close_to_what_the_tars_took(
    tmp_path: Path, heads: list[split_tar.Head], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reader waits for the tars once AHEAD_BYTES of members wait for them, so an
    archive larger than the memory is not read twice (a page read for its header,
    evicted before a tar takes it)."""
    tree = tmp_path / "tree"
    for i in range(8):
        (tree / f"d{i}").mkdir(parents=True)
        for j in range(8):
            (tree / f"d{i}" / f"f{j}").write_bytes(os.urandom(20_000))
    archive = tmp_path / "a.tar"
    gnu_tar("-cf", archive, ".", cwd=tree)
    monkeypatch.setattr(split_tar, "AHEAD_BYTES", 50_000)
    monkeypatch.setattr(split_tar, "_PIPE_BYTES", 4096)  # the pipes hold next to nothing
    waiting: list[int] = []
    real = split_tar._Tars.send

    def send(self: Any, runs: list[tuple[int, int]], files: int) -> None:
        real(self, runs, files)
        waiting.append(sum(tar.waiting for tar in self._tars if tar.pipe >= 0))

    monkeypatch.setattr(split_tar._Tars, "send", send)
    extract(archive, tmp_path / "dest")
    assert heads[0].complete and heads[0].files == 64
    assert len(waiting) >= 32 and max(waiting) <= 50_000
    assert snapshot(tmp_path / "dest").keys() == snapshot(tree).keys()


def test_large_files_are_left_to_the_writer_once_they_are_the_rule(
    tmp_path: Path, heads: list[split_tar.Head], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past SAMPLE_FILES files averaging more than SMALL bytes, the tars' part ends
    (the writer, copying in the kernel, is faster there) and the writer goes on."""
    monkeypatch.setattr(split_tar, "SAMPLE_FILES", 8)
    tree = tmp_path / "tree"
    (tree / "d").mkdir(parents=True)
    for i in range(20):
        (tree / "d" / f"f{i:02d}").write_bytes(os.urandom(split_tar.SMALL + 1000))
    archive = tmp_path / "a.tar"
    gnu_tar("-cf", archive, "d", cwd=tree)
    split, ordered = both_ways(archive, tmp_path, monkeypatch)
    assert split == ordered
    assert not heads[0].complete and heads[0].files == 8
