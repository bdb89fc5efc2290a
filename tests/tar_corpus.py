"""Archives that other tools write, and the trees they extract to.

A corpus of real archives for the compatibility test: GNU tar in every format it
writes (v7, oldgnu, gnu, ustar, posix), incremental dumps, updates and appends
(the same member twice), sparse files in every sparse format, volume labels,
multi-volume sets, long names and link targets, hard links, numbers too large for
octal fields; Python's tarfile (pax global headers); CPython's own test archives
(``tests/data/cpython-*.tar.xz``: ``testtar.tar``, where old ustar, v7, GNU, pax,
sparse and vendor headers meet in one file, and ``recursion.tar``); hand-built
headers for what no writer here produces on demand (base-256 sizes, unknown types,
contiguous files); and the same members compressed, and zips with duplicate names. Each case
is compared with what the reference extractor (GNU tar, or unzip for zips) leaves:
:func:`snapshot` describes a tree member by member.

Modes are compared after stager's documented policy
(``stager.fs.seal.FILE_MODE``: every file is 0444; directories keep the
default mode), ownership not at all (stager writes as the daemon's user).
"""

from __future__ import annotations

import hashlib
import io
import lzma
import os
import shutil
import stat
import subprocess
import tarfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from stager.fs.seal import FILE_MODE

MTIME = 1_500_000_000


@dataclass(frozen=True)
class Case:
    """Archives extracted one after the other into one folder, and what to expect."""

    build: Callable[[Path], list[Path]]  # work folder -> archives, in extraction order
    # A regex the refusal must match where the reference extractor fails too; None:
    # the reference succeeds and stager must leave the same tree.
    refusal: str | None = None
    reference: str = "tar"  # or "unzip"
    needs: tuple[str, ...] = ()  # programs the case needs besides tar


# -- source trees ----------------------------------------------------------------


def _write(path: Path, data: bytes, mode: int = 0o644, mtime: int = MTIME) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    path.chmod(mode)
    os.utime(path, (mtime, mtime))


def _settle_dirs(root: Path, mtime: int = MTIME) -> None:
    """Fixed directory mtimes (deepest first: creating entries changes a parent's)."""
    for dirpath, _dirs, _files in sorted(os.walk(root), key=lambda w: -w[0].count("/")):
        os.utime(dirpath, (mtime, mtime), follow_symlinks=False)


def basic_tree(root: Path) -> Path:
    """What any format can hold: short names, files of awkward sizes, every common
    mode, links (symbolic and hard), an empty folder."""
    _write(root / "a.txt", b"alpha\n")
    _write(root / "empty", b"")
    _write(root / "block", bytes(range(256)) * 2)  # exactly one 512-byte block
    _write(root / "block+1", os.urandom(513))
    _write(root / "big.bin", os.urandom(200_000), mtime=MTIME - 86_400 * 365 * 20)
    _write(root / "run.sh", b"#!/bin/sh\necho hi\n", 0o755)
    _write(root / "private", b"secret", 0o600)
    _write(root / "readonly", b"ro", 0o444)
    _write(root / "setuid", b"su", 0o4755)
    _write(root / "group-write", b"gw", 0o664)
    _write(root / "ünïcödé.txt", "ünïcödé".encode())
    _write(root / "with space.txt", b"space")
    _write(root / "d/e/f.txt", b"deep")
    _write(root / "d/e/g.jpg", os.urandom(3000))
    (root / "emptydir").mkdir()
    os.link(root / "a.txt", root / "d/hard-to-a")
    os.link(root / "big.bin", root / "hard-to-big")
    os.symlink("../a.txt", root / "d/link-up")
    os.symlink("d/e", root / "link-to-dir")
    os.symlink("nowhere", root / "dangling")
    for link in ("d/link-up", "link-to-dir", "dangling"):
        os.utime(root / link, (MTIME, MTIME), follow_symlinks=False)
    _settle_dirs(root)
    return root


def long_tree(root: Path) -> Path:
    """Names past ustar's 100 (and 100 + 155) bytes, and long link targets."""
    split = root / ("p" * 80) / ("q" * 60) / "fits-a-ustar-prefix.txt"
    _write(split, b"prefix")
    _write(root / ("n" * 150 + ".txt"), b"long component")
    deep = root.joinpath(*[f"level{i:02d}-{'x' * 20}" for i in range(12)])
    _write(deep / "deep.txt", b"more than 256 bytes of path")
    os.symlink(os.path.relpath(deep / "deep.txt", root), root / "long-target")
    os.utime(root / "long-target", (MTIME, MTIME), follow_symlinks=False)
    os.link(deep / "deep.txt", root / "hard-to-long")
    _settle_dirs(root)
    return root


def sparse_tree(root: Path) -> Path:
    """Files with holes: data in the middle, at the end, none at all."""
    root.mkdir(parents=True)
    for name, size, regions in (
        ("middle", 3 << 20, [(1 << 20, b"m" * 5000)]),
        ("tail", 2 << 20, [(0, b"h" * 100), ((2 << 20) - 10, b"t" * 10)]),
        ("all-hole", 1 << 20, []),
        ("many", 1 << 20, [(i * 65536 + 7, os.urandom(1000)) for i in range(16)]),
    ):
        with open(root / name, "wb") as out:
            out.truncate(size)
            for offset, data in regions:
                out.seek(offset)
                out.write(data)
        os.utime(root / name, (MTIME, MTIME))
    _settle_dirs(root)
    return root


# -- writers -----------------------------------------------------------------------


def gnu_tar(*args: str | Path, cwd: Path | None = None) -> None:
    subprocess.run(["tar", *map(str, args)], check=True, cwd=cwd, capture_output=True)


def _tar_of(tree: Callable[[Path], Path], *flags: str) -> Callable[[Path], list[Path]]:
    def build(work: Path) -> list[Path]:
        src = tree(work / "src")
        archive = work / "a.tar"
        gnu_tar(*flags, "-cf", archive, "-C", src, ".")
        return [archive]

    return build


def _incremental(work: Path) -> list[Path]:
    """Level 0 and level 1 of a listed-incremental (``-g``) dump, extracted in turn."""
    src = basic_tree(work / "src")
    _write(src / ("long-" + "l" * 120), b"a GNU long name in an incremental dump")
    snapshot = work / "snapshot"
    gnu_tar("-g", snapshot, "-cf", work / "level0.tar", "-C", src, ".")
    (src / "private").unlink()
    _write(src / "a.txt", b"alpha, changed\n", mtime=MTIME + 100)
    _write(src / "d/new.txt", b"new at level 1", mtime=MTIME + 100)
    _settle_dirs(src, MTIME + 200)
    gnu_tar("-g", snapshot, "-cf", work / "level1.tar", "-C", src, ".")
    return [work / "level0.tar", work / "level1.tar"]


def _updated(work: Path, fmt: str = "gnu") -> list[Path]:
    """``tar -u`` and ``tar -r``: members that appear twice or more, the last one wins."""
    src = basic_tree(work / "src")
    archive = work / "a.tar"
    gnu_tar(f"--format={fmt}", "-cf", archive, "-C", src, ".")
    _write(src / "a.txt", b"alpha, then updated\n" * 1000, mtime=MTIME + 10)  # hard-linked
    _write(src / "big.bin", os.urandom(150_000), mtime=MTIME + 10)
    (src / "dangling").unlink()
    _write(src / "dangling", b"was a symlink", mtime=MTIME + 10)
    gnu_tar(f"--format={fmt}", "-uf", archive, "-C", src, ".")
    other = work / "other"
    _write(other / "run.sh", b"#!/bin/sh\necho appended\n", 0o700, MTIME + 20)
    _write(other / "emptydir", b"a file where a folder was", mtime=MTIME + 20)
    (other / "d").mkdir()
    os.symlink("e/f.txt", other / "d/hard-to-a")  # a symlink replaces a hard link
    _write(other / "link-to-dir/inside.txt", b"a folder replaces a symlink", mtime=MTIME + 20)
    _settle_dirs(other, MTIME + 20)
    gnu_tar(
        f"--format={fmt}",
        "-rf",
        archive,
        "-C",
        other,
        "./run.sh",
        "./emptydir",
        "./d/hard-to-a",
        "./link-to-dir",
    )
    gnu_tar(f"--format={fmt}", "-rf", archive, "-C", other, "./run.sh")  # three copies
    return [archive]


def _updated_many(work: Path) -> list[Path]:
    """Members updated (``tar -u``) far apart from their first copies, and hard links to
    files written many members earlier: the copies land in different batches of
    extraction workers, and only the order of the archive may decide what is left."""
    src = work / "src"
    for i in range(130):
        _write(src / f"c{i % 2}" / f"f{i:03d}.bin", os.urandom(256 << 10))
    for i in range(0, 130, 6):
        os.link(src / f"c{i % 2}" / f"f{i:03d}.bin", src / f"hard{i:03d}.bin")
    _settle_dirs(src)
    archive = work / "a.tar"
    gnu_tar("-cf", archive, "-C", src, ".")
    for i in range(1, 130, 3):
        _write(src / f"c{i % 2}" / f"f{i:03d}.bin", os.urandom(10_000), mtime=MTIME + 60)
    _settle_dirs(src, MTIME + 60)
    gnu_tar("-uf", archive, "-C", src, ".")
    return [archive]


def _compressed(flag: str, suffix: str) -> Callable[[Path], list[Path]]:
    def build(work: Path) -> list[Path]:
        (plain,) = _updated(work)
        archive = work / f"a.{suffix}"
        data = subprocess.run([flag, "-c", str(plain)], check=True, capture_output=True).stdout
        archive.write_bytes(data)
        return [archive]

    return build


def _labelled(fmt: str) -> Callable[[Path], list[Path]]:
    return _tar_of(basic_tree, f"--format={fmt}", "-V", "Dataset volume 1")


def _multi_volume(volume: int) -> Callable[[Path], list[Path]]:
    def build(work: Path) -> list[Path]:
        src = work / "src"
        _write(src / "big.bin", os.urandom(250_000))
        names = [work / f"vol{i}.tar" for i in range(1, 4)]
        flags = [arg for name in names for arg in ("-f", str(name))]
        gnu_tar("-c", "-M", "-L", "100", *flags, "-C", src, "big.bin")
        return [names[volume - 1]]

    return build


def _big_numbers(fmt: str) -> Callable[[Path], list[Path]]:
    """ids past octal's 2,097,151 and mtimes before 1970 / after 2242: base-256 in GNU
    headers, pax records in posix ones."""

    def build(work: Path) -> list[Path]:
        src = work / "src"
        _write(src / "past.txt", b"before 1970", mtime=-86_400 * 400)
        _write(src / "future.txt", b"after 2242", mtime=9_000_000_000)
        _write(src / "now.txt", b"ids")
        archive = work / "a.tar"
        gnu_tar(
            f"--format={fmt}",
            "--owner=bigid:3000000",
            "--group=bigid:4000000",
            "-cf",
            archive,
            "-C",
            src,
            "past.txt",
            "future.txt",
            "now.txt",
        )
        return [archive]

    return build


def _sparse(*flags: str) -> Callable[[Path], list[Path]]:
    return _tar_of(sparse_tree, "--sparse", *flags)


def _huge_sparse(work: Path) -> list[Path]:
    """A sparse member of 8 GiB and more: its size, map offsets and real size are
    base-256 numbers in a GNU header (GNU tar writes holes, not 8 GiB)."""
    src = work / "src"
    src.mkdir(parents=True)
    with open(src / "huge.bin", "wb") as out:
        out.truncate((8 << 30) + 4096)
        out.seek(4 << 30)
        out.write(b"four GiB in")
        out.seek((8 << 30) + 100)
        out.write(b"past eight GiB")
    os.utime(src / "huge.bin", (MTIME, MTIME))
    archive = work / "a.tar"
    gnu_tar("--format=gnu", "--sparse", "-cf", archive, "-C", src, "huge.bin")
    return [archive]


# -- tarfile and hand-built headers -------------------------------------------------


def _tarinfo(name: str, data: bytes = b"", kind: bytes = tarfile.REGTYPE, **extra) -> tuple:
    info = tarfile.TarInfo(name)
    info.type, info.size, info.mtime, info.mode = kind, len(data), MTIME, 0o644
    for key, value in extra.items():
        setattr(info, key, value)
    return info, (io.BytesIO(data) if info.isreg() else None)


def _python_pax(work: Path) -> list[Path]:
    """tarfile in pax format: global headers first, unicode and fractional mtimes."""
    src = basic_tree(work / "src")
    long_tree(src / "long")
    archive = work / "a.tar"
    with tarfile.open(
        archive, "w", format=tarfile.PAX_FORMAT, pax_headers={"comment": "global, for all"}
    ) as tar:
        tar.add(src, arcname="top")
        info, data = _tarinfo("top/fraction.txt", b"f", mtime=MTIME + 0.75)
        tar.addfile(info, data)
    return [archive]


def _python_gnu(work: Path) -> list[Path]:
    src = basic_tree(work / "src")
    long_tree(src / "long")
    archive = work / "a.tar"
    with tarfile.open(archive, "w", format=tarfile.GNU_FORMAT) as tar:
        tar.add(src, arcname=".")
    return [archive]


def _header(info: tarfile.TarInfo, fmt: int = tarfile.GNU_FORMAT) -> bytearray:
    return bytearray(info.tobuf(fmt, "utf-8", "surrogateescape"))


def _rechecksum(block: bytearray) -> None:
    block[148:156] = b" " * 8
    block[148:155] = b"%06o\0" % (sum(block[:512]))
    block[155:156] = b" "


def _hand_built(work: Path) -> list[Path]:
    """Headers no writer here makes on demand: a base-256 size (legal for any size),
    a contiguous file ('7'), a vendor type GNU tar extracts as a file ('Z'), a POSIX
    header with a prefix, and an old GNU header whose atime/ctime fill the prefix area."""
    out = io.BytesIO()

    def member(block: bytearray, data: bytes) -> None:
        out.write(block)
        out.write(data + bytes(-len(data) % 512))

    data = b"a size in base-256"
    block = _header(_tarinfo("base256-size.txt", data)[0])
    block[124:136] = b"\x80" + len(data).to_bytes(11, "big")
    _rechecksum(block)
    member(block, data)
    for kind, name in ((tarfile.CONTTYPE, "contiguous.bin"), (b"Z", "vendor-type.bin")):
        data = name.encode() * 3
        block = _header(_tarinfo(name, data)[0])
        block[156:157] = kind
        _rechecksum(block)
        member(block, data)
    data = b"prefix + name"
    block = _header(_tarinfo("name.txt", data)[0], tarfile.USTAR_FORMAT)
    block[345 : 345 + 12] = b"ustar-prefix"
    _rechecksum(block)
    member(block, data)
    data = b"atime and ctime where ustar keeps its prefix"
    block = _header(_tarinfo("gnu-times.txt", data)[0])
    block[345:357] = b"%011o\0" % (MTIME + 5)
    block[357:369] = b"%011o\0" % (MTIME + 6)
    _rechecksum(block)
    member(block, data)
    out.write(bytes(1024))
    archive = work / "a.tar"
    archive.write_bytes(out.getvalue())
    return [archive]


def _replacements(work: Path) -> list[Path]:
    """Later members of another kind at the same name, each the way GNU tar resolves it."""
    members = [
        _tarinfo("file-then-dir", b"file"),
        _tarinfo("file-then-dir", kind=tarfile.DIRTYPE),
        _tarinfo("file-then-dir/inside", b"in"),
        _tarinfo("emptydir-then-file", kind=tarfile.DIRTYPE),
        _tarinfo("emptydir-then-file", b"file over an empty folder"),
        _tarinfo("target", b"t"),
        _tarinfo("symlink-then-file", kind=tarfile.SYMTYPE, linkname="target"),
        _tarinfo("symlink-then-file", b"file over a symlink"),
        _tarinfo("file-then-symlink", b"file"),
        _tarinfo("file-then-symlink", kind=tarfile.SYMTYPE, linkname="target"),
        _tarinfo("symlink-then-dir", kind=tarfile.SYMTYPE, linkname="target"),
        _tarinfo("symlink-then-dir", kind=tarfile.DIRTYPE),
        _tarinfo("symlink-then-dir/x", b"in the folder, not through the link"),
        _tarinfo("emptydir-then-symlink", kind=tarfile.DIRTYPE),
        _tarinfo("emptydir-then-symlink", kind=tarfile.SYMTYPE, linkname="target"),
        _tarinfo("v1", b"first version"),
        _tarinfo("hard-to-v1", kind=tarfile.LNKTYPE, linkname="v1"),
        _tarinfo("v1", b"second version: the hard link keeps the first"),
        _tarinfo("hard-then-file", kind=tarfile.LNKTYPE, linkname="target"),
        _tarinfo("hard-then-file", b"a file over a hard link leaves its target alone"),
        _tarinfo("dir", kind=tarfile.DIRTYPE, mtime=MTIME - 50),
        _tarinfo("dir/x", b"x"),
        _tarinfo("dir", kind=tarfile.DIRTYPE, mtime=MTIME - 99),
        _tarinfo("folder/y", b"y"),
        _tarinfo("through", kind=tarfile.SYMTYPE, linkname="folder"),
        _tarinfo("through/z", b"written through a symlink of the archive, as GNU tar does"),
        # Last: GNU tar sets a folder's mtime once it leaves it, and a write through
        # the link after that would move it again.
        _tarinfo("folder", kind=tarfile.DIRTYPE),
    ]
    archive = work / "a.tar"
    with tarfile.open(archive, "w", format=tarfile.GNU_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, data)
    return [archive]


def _members(*members: tuple[str, bytes | None, str]) -> Callable[[Path], list[Path]]:
    """A GNU-format tar of ``(name, data, link target)``: data None for a hard link."""

    def build(work: Path) -> list[Path]:
        archive = work / "a.tar"
        with tarfile.open(archive, "w", format=tarfile.GNU_FORMAT) as tar:
            for name, data, target in members:
                if data is None:
                    info, data = _tarinfo(name, kind=tarfile.LNKTYPE, linkname=target)
                else:
                    info, data = _tarinfo(name, data)
                tar.addfile(info, data)
        return [archive]

    return build


DATA = Path(__file__).parent / "data"


def _without_special(raw: bytes) -> bytes:
    """The archive ``raw`` less its device and FIFO members, every other header (long
    names, pax records, sparse maps) byte for byte: stager refuses those members, and GNU
    tar as root would make them."""
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        members, end = tar.getmembers(), tar.offset
    spans = zip(members, [m.offset for m in members[1:]] + [end], strict=True)
    kept = [raw[m.offset : stop] for m, stop in spans if not (m.ischr() or m.isblk() or m.isfifo())]
    return b"".join(kept) + raw[end:]


def _cpython(
    name: str, compress: bool = False, whole: bool = False
) -> Callable[[Path], list[Path]]:
    """One of CPython's test archives (from its ``Lib/test``), its special members left
    out unless ``whole``; xz-compressed again with ``compress`` (then read as a stream)."""

    def build(work: Path) -> list[Path]:
        raw = lzma.decompress((DATA / f"cpython-{name}.tar.xz").read_bytes())
        raw = raw if whole else _without_special(raw)
        archive = work / (f"{name}.tar.xz" if compress else f"{name}.tar")
        archive.write_bytes(lzma.compress(raw) if compress else raw)
        return [archive]

    return build


def _zip_duplicates(work: Path) -> list[Path]:
    archive = work / "a.zip"
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in (
            ("d/a.txt", b"first"),
            ("d/b.txt", b"b" * 70_000),
            ("d/a.txt", b"second, longer than the first"),
            ("d/b.txt", b"short"),
        ):
            info = zipfile.ZipInfo(name, date_time=(2020, 1, 2, 3, 4, 6))
            info.external_attr = 0o644 << 16
            info.create_system = 3
            zf.writestr(info, data)
    return [archive]


def _zip_of_tree(work: Path) -> list[Path]:
    src = basic_tree(work / "src")
    archive = work / "a.zip"
    subprocess.run(["zip", "-q", "-r", "-y", str(archive), "."], check=True, cwd=src)
    return [archive]


CASES: dict[str, Case] = {
    **{
        f"gnu-tar-{fmt}": Case(_tar_of(basic_tree, f"--format={fmt}"))
        for fmt in ("v7", "oldgnu", "gnu", "ustar", "posix")
    },
    **{
        f"gnu-tar-{fmt}-long-names": Case(_tar_of(long_tree, f"--format={fmt}"))
        for fmt in ("oldgnu", "gnu", "posix")
    },
    "gnu-tar-incremental": Case(_incremental),
    "gnu-tar-update-append": Case(_updated),
    "gnu-tar-update-append-posix": Case(lambda w: _updated(w, "posix")),
    "gnu-tar-update-many": Case(_updated_many),
    "gnu-tar-update-append-gz": Case(_compressed("gzip", "tar.gz"), needs=("gzip",)),
    "gnu-tar-update-append-bz2": Case(_compressed("bzip2", "tar.bz2"), needs=("bzip2",)),
    "gnu-tar-update-append-xz": Case(_compressed("xz", "tar.xz"), needs=("xz",)),
    "gnu-tar-update-append-zst": Case(_compressed("zstd", "tar.zst"), needs=("zstd",)),
    **{f"gnu-tar-label-{fmt}": Case(_labelled(fmt)) for fmt in ("gnu", "posix")},
    **{
        f"gnu-tar-sparse-{name}": Case(_sparse(*flags))
        for name, flags in (
            ("oldgnu", ("--format=oldgnu",)),
            ("gnu", ("--format=gnu",)),
            ("pax-0.0", ("--format=posix", "--sparse-version=0.0")),
            ("pax-0.1", ("--format=posix", "--sparse-version=0.1")),
            ("pax-1.0", ("--format=posix", "--sparse-version=1.0")),
        )
    },
    "gnu-tar-sparse-8gib": Case(_huge_sparse),
    **{f"gnu-tar-big-numbers-{fmt}": Case(_big_numbers(fmt)) for fmt in ("gnu", "posix")},
    "gnu-tar-multi-volume-first": Case(_multi_volume(1), refusal="multi-volume"),
    "gnu-tar-multi-volume-middle": Case(_multi_volume(2), refusal="multi-volume"),
    "python-tarfile-pax-global": Case(_python_pax),
    "python-tarfile-gnu": Case(_python_gnu),
    "hand-built-headers": Case(_hand_built),
    "replaced-members": Case(_replacements),
    "file-over-a-nonempty-folder": Case(
        _members(("d/in", b"x", ""), ("d", b"a file", "")), refusal="GNU tar fails here too"
    ),
    "file-under-a-file": Case(
        _members(("d", b"a file", ""), ("d/in", b"x", "")), refusal="GNU tar fails here too"
    ),
    "hard-link-to-a-later-member": Case(
        _members(("early", None, "late"), ("late", b"x", "")), refusal="GNU tar fails here too"
    ),
    "cpython-testtar": Case(_cpython("testtar")),
    "cpython-testtar-xz": Case(_cpython("testtar", compress=True)),
    "cpython-recursion": Case(_cpython("recursion", whole=True), refusal="truncated or corrupt"),
    "zip-duplicates": Case(_zip_duplicates, reference="unzip", needs=("unzip",)),
    "zip-info-zip": Case(_zip_of_tree, reference="unzip", needs=("zip", "unzip")),
}


# -- reference extraction and comparison ----------------------------------------------


def reference_extract(case: Case, archives: list[Path], dest: Path) -> str | None:
    """Extract with the reference tool; its error output if it failed, else None."""
    dest.mkdir(parents=True, exist_ok=True)
    for archive in archives:
        if case.reference == "unzip":
            command = ["unzip", "-o", "-q", str(archive), "-d", str(dest)]
        else:
            command = ["tar", "--no-same-owner", "-xf", str(archive), "-C", str(dest)]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            return done.stderr.strip() or f"exit status {done.returncode}"
    return None


def snapshot(root: Path, link_times: bool = True) -> dict[str, tuple]:
    """Every entry under ``root`` (not ``root`` itself): its type and what matters for it.

    Files: policy mode, size, content, mtime, and the first name of their hard-link
    group; symlinks: target and mtime (unless not ``link_times``: unzip leaves a
    link's own time alone); folders: mtime.
    """
    entries: dict[str, tuple] = {}
    inodes: dict[int, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                entries[rel] = ("symlink", os.readlink(path), int(st.st_mtime) * link_times)
            elif stat.S_ISDIR(st.st_mode):
                entries[rel] = ("dir", int(st.st_mtime))
            elif stat.S_ISREG(st.st_mode):
                group = inodes.setdefault(st.st_ino, rel) if st.st_nlink > 1 else rel
                entries[rel] = (
                    "file",
                    oct(FILE_MODE),
                    st.st_size,
                    content_digest(path, st.st_size),
                    int(st.st_mtime),
                    group,
                )
            else:
                entries[rel] = ("special", stat.S_IFMT(st.st_mode))
    return entries


DIGEST_BLOCK = 1 << 16


def content_digest(path: str, size: int) -> str:
    """sha256 over the file's non-zero 64 KiB blocks and their positions.

    Equal for equal contents however the zeros are stored (holes or data), and it
    reads only the data of a sparse file: an 8 GiB file of holes is hashed at once.
    """
    digest = hashlib.sha256(str(size).encode())
    fd = os.open(path, os.O_RDONLY)
    try:
        offset, last = 0, -1
        while offset < size:
            try:
                start = os.lseek(fd, offset, os.SEEK_DATA)
            except OSError:  # ENXIO: no data after offset
                break
            end = os.lseek(fd, start, os.SEEK_HOLE)
            for index in range(max(start // DIGEST_BLOCK, last + 1), -(-end // DIGEST_BLOCK)):
                block = os.pread(fd, DIGEST_BLOCK, index * DIGEST_BLOCK)
                if block.count(0) != len(block):
                    digest.update(index.to_bytes(8, "big") + block)
                last = index
            offset = end
    finally:
        os.close(fd)
    return digest.hexdigest()


def missing_tools(case: Case) -> list[str]:
    return [tool for tool in ("tar", *case.needs) if shutil.which(tool) is None]
