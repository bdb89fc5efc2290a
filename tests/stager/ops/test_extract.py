"""extract: real archives of every format round-trip byte for byte, with mtimes."""

from __future__ import annotations

import errno
import hashlib
import io
import os
import shutil
import subprocess
import tarfile
import threading
import time
import zipfile
from pathlib import Path

import pytest
import zstandard

from stager.archive import devkit
from stager.core.errors import (
    Cancelled,
    CorruptArchive,
    SourceNotFound,
    SpecialSource,
    UnknownFormat,
    UnsafeArchiveMember,
    UnsafePath,
    VerifyFailed,
)
from stager.fs import fastcopy
from stager.fs.sizes import sum_sizes
from stager.ops import extract
from stager.ops.base import CheckContext, OpContext
from stager.ops.extract import ExtractStep
from stager.wire.progress import Progress

# Every test here runs on threads and on worker processes (see conftest).
pytestmark = pytest.mark.usefixtures("pool")

MTIME = 1_600_000_000  # fixed, far from "now", so a kept mtime is unmistakable
FORMATS = ["tar", "tar.gz", "tar.bz2", "tar.xz", "tar.zst", "zip"]


def make_tree(root: Path) -> Path:
    files = {
        "top/a.txt": b"alpha\n",
        "top/empty.bin": b"",
        "top/sub/b.bin": os.urandom(70_000),
        "top/sub/deeper/c.jpg": os.urandom(5_000) * 3,
        "top/big.bin": os.urandom(1_200_000),
    }
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    (root / "top/run.sh").write_bytes(b"#!/bin/sh\n")
    (root / "top/run.sh").chmod(0o755)
    for path in sorted(root.rglob("*"), reverse=True):
        os.utime(path, (MTIME, MTIME))
    return root


def digest(root: Path) -> dict[str, tuple[str, int]]:
    """sha256 and mtime of every regular file under ``root``, by relative path."""
    out = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.is_symlink():
            sha = hashlib.sha256(path.read_bytes()).hexdigest()
            out[path.relative_to(root).as_posix()] = (sha, int(path.stat().st_mtime))
    return out


def build(fmt: str, tree: Path, out: Path) -> Path:
    """An archive of ``tree``'s contents in ``fmt``, made with the stdlib writers."""
    if fmt == "zip":
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
            for path in sorted(tree.rglob("*")):
                zf.write(path, path.relative_to(tree).as_posix())
        return out
    buffer = io.BytesIO()
    mode = {"tar": "w", "tar.gz": "w:gz", "tar.bz2": "w:bz2", "tar.xz": "w:xz"}.get(fmt, "w")
    with tarfile.open(fileobj=buffer, mode=mode) as tar:
        tar.add(tree, arcname=".")
    data = buffer.getvalue()
    if fmt == "tar.zst":
        data = zstandard.ZstdCompressor().compress(data)
    out.write_bytes(data)
    return out


def run_extract(
    src: Path, root: Path, workers: int = 2, verify: str = "size", **fields
) -> OpContext:
    ctx = OpContext(root=root, progress=Progress(), workers=workers, verify=verify)
    step = ExtractStep(src=str(src), **fields)
    extract.check(step, CheckContext(verify=verify))
    extract.run(step, ctx)
    return ctx


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    return make_tree(tmp_path / "tree")


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_is_byte_identical_with_mtimes(fmt: str, tree: Path, tmp_path: Path):
    archive = build(fmt, tree, tmp_path / f"data.{fmt}")
    dest = tmp_path / "dest"
    ctx = run_extract(archive, dest)
    assert digest(dest) == digest(tree)
    # Created as the published tree keeps every file: 0444, whatever the member said.
    assert (dest / "top/run.sh").stat().st_mode & 0o7777 == 0o444
    assert int((dest / "top/sub").stat().st_mtime) == MTIME
    snap = ctx.progress.snapshot()
    assert snap.bytes_done == snap.bytes_total == archive.stat().st_size
    assert snap.files_done == len(digest(tree))


def test_gnu_tar_gz_and_zstd_cli_archives(tree: Path, tmp_path: Path):
    tgz = tmp_path / "gnu.tgz"
    subprocess.run(["tar", "-czf", tgz, "-C", tree, "top"], check=True)
    run_extract(tgz, tmp_path / "a")
    assert digest(tmp_path / "a") == digest(tree)
    if shutil.which("zstd"):
        tzst = tmp_path / "gnu.tar.zst"
        subprocess.run(["tar", "--zstd", "-cf", tzst, "-C", tree, "top"], check=True)
        run_extract(tzst, tmp_path / "b", format="tar.zst")
        assert digest(tmp_path / "b") == digest(tree)


def test_rerun_in_same_directory_overwrites(tree: Path, tmp_path: Path):
    archive = build("tar", tree, tmp_path / "data.tar")
    dest = tmp_path / "dest"
    run_extract(archive, dest)
    (dest / "top/a.txt").write_bytes(b"half-written")
    (dest / "top/a.txt").chmod(0o400)
    run_extract(archive, dest)
    assert digest(dest) == digest(tree)


@pytest.mark.parametrize(("fmt", "strip"), [("tar", 2), ("zip", 1)])
def test_strip_components(fmt: str, strip: int, tree: Path, tmp_path: Path):
    # The tar's names start with "./top/" (and "./" counts, like GNU tar); the zip's with "top/".
    archive = build(fmt, tree, tmp_path / f"data.{fmt}")
    dest = tmp_path / "dest"
    run_extract(archive, dest, strip_components=strip)
    assert digest(dest) == digest(tree / "top")


def test_strip_components_skips_short_members(tree: Path, tmp_path: Path):
    archive = build("tar", tree, tmp_path / "data.tar")
    dest = tmp_path / "dest"
    run_extract(archive, dest, strip_components=3)
    assert sorted(digest(dest)) == ["b.bin", "deeper/c.jpg"]


@pytest.mark.parametrize("outer", ["tar", "tar.gz", "zip"])
def test_nested_archives_land_in_per_archive_folders(outer: str, tmp_path: Path):
    classes = {}
    inner_dir = tmp_path / "inner"
    inner_dir.mkdir()
    for name, fmt in [("n01440764", "tar"), ("n01443537", "tar"), ("n09999999", "tar.gz")]:
        tree = make_tree(tmp_path / f"tree-{name}")
        build(fmt, tree / "top", inner_dir / f"{name}.{fmt}")
        classes[name] = digest(tree / "top")
    (inner_dir / "README.txt").write_text("not an archive")
    archive = build(outer, inner_dir, tmp_path / f"outer.{outer}")
    dest = tmp_path / "dest"
    run_extract(archive, dest, nested=True)
    for name, expected in classes.items():
        assert digest(dest / name) == expected
    assert sorted(p.name for p in dest.iterdir()) == sorted([*classes, "README.txt"])


def test_truncated_tar_gz_is_corrupt(tree: Path, tmp_path: Path):
    (tree / "top/more.bin").write_bytes(os.urandom(400_000))
    archive = build("tar.gz", tree, tmp_path / "data.tar.gz")
    data = archive.read_bytes()
    archive.write_bytes(data[: len(data) // 2])
    ctx = OpContext(root=tmp_path / "dest", progress=Progress())
    with pytest.raises(CorruptArchive, match=str(archive)):
        extract.run(ExtractStep(src=str(archive)), ctx)


def test_truncated_plain_tar_is_corrupt(tree: Path, tmp_path: Path):
    archive = build("tar", tree, tmp_path / "data.tar")
    data = archive.read_bytes()
    archive.write_bytes(data[: len(data) - 600_000])
    ctx = OpContext(root=tmp_path / "dest", progress=Progress())
    with pytest.raises(CorruptArchive, match="truncated or corrupt"):
        extract.run(ExtractStep(src=str(archive)), ctx)


@pytest.mark.parametrize("name", ["garbage.tar.gz", "garbage.tar", "garbage.zip"])
def test_garbage_named_like_an_archive_is_corrupt(name: str, tmp_path: Path):
    garbage = tmp_path / name
    garbage.write_bytes(os.urandom(4096))
    with pytest.raises(CorruptArchive, match=str(garbage)):
        extract.check(ExtractStep(src=str(garbage)), CheckContext())


def test_gzip_of_garbage_is_corrupt(tmp_path: Path):
    import gzip

    archive = tmp_path / "data.tar.gz"
    archive.write_bytes(gzip.compress(os.urandom(10_000)))
    with pytest.raises(CorruptArchive, match=str(archive)):
        extract.check(ExtractStep(src=str(archive)), CheckContext())


def bytes_read_by_this_process() -> int:
    """What this process has read through read(2) and its kin (the kernel's count)."""
    io_counts = Path("/proc/self/io").read_text().split()
    return int(io_counts[io_counts.index("rchar:") + 1])


@pytest.fixture(scope="module", params=FORMATS)
def large_archive(request: pytest.FixtureRequest, tmp_path_factory) -> Path:
    """3 MB of incompressible files (like images) in ``request.param``."""
    base = tmp_path_factory.mktemp("large")
    for i in range(3):
        (base / "tree" / f"d{i}").mkdir(parents=True)
        (base / "tree" / f"d{i}" / "x.bin").write_bytes(os.urandom(1_000_000))
    return build(request.param, base / "tree", base / f"data.{request.param}")


# What a check may read of any archive: a few KiB for the first header, except where
# the format's unit of decoding is larger (a zstd block is up to 128 KiB; bz2 decodes
# whole blocks of up to 900 kB of input).
CHECK_READ_BUDGET = {"tar.zst": 160 << 10, "tar.bz2": 1_000_000}


def test_check_reads_a_few_blocks_of_a_large_archive_whatever_its_format(large_archive: Path):
    """The check reads the archive from the source, and extraction reads it again
    from an open of its own: over a network filesystem every byte the check reads is
    a byte more from the shared storage (0.8 MB per .tar.gz over sshfs, when igzip
    filled its 512 KiB buffer; zstd fills 1 MiB)."""
    budget = CHECK_READ_BUDGET.get(large_archive.name.removeprefix("data."), 64 << 10)
    before = bytes_read_by_this_process()
    extract.check(ExtractStep(src=str(large_archive)), CheckContext())
    read = bytes_read_by_this_process() - before
    assert read <= budget, (large_archive.name, read, large_archive.stat().st_size)


def test_unknown_format_fails_in_check(tmp_path: Path):
    blob = tmp_path / "data.bin"
    blob.write_bytes(b"hello, not an archive" * 100)
    with pytest.raises(UnknownFormat, match=str(blob)):
        extract.check(ExtractStep(src=str(blob)), CheckContext())


def test_wrong_explicit_format_fails_in_check(tree: Path, tmp_path: Path):
    archive = build("tar.gz", tree, tmp_path / "data.tar.gz")
    with pytest.raises(CorruptArchive, match="set format"):
        extract.check(ExtractStep(src=str(archive), format="zip"), CheckContext())


def test_missing_source(tmp_path: Path):
    with pytest.raises(SourceNotFound, match="nope.tar"):
        extract.check(ExtractStep(src=str(tmp_path / "nope.tar")), CheckContext())


@pytest.mark.parametrize("fmt", FORMATS)
def test_check_estimates_output_size(fmt: str, tree: Path, tmp_path: Path):
    archive = build(fmt, tree, tmp_path / f"data.{fmt}")
    estimate = extract.check(ExtractStep(src=str(archive)), CheckContext())
    assert estimate >= archive.stat().st_size
    if fmt in ("tar", "tar.gz"):
        assert estimate >= sum(len(b) for b in map(Path.read_bytes, tree.rglob("*.bin")))


def test_detects_format_by_content_not_name(tree: Path, tmp_path: Path):
    archive = build("tar.zst", tree, tmp_path / "misnamed.tar.gz")
    run_extract(archive, tmp_path / "dest")
    assert digest(tmp_path / "dest") == digest(tree)


def test_cancellation_raises_cancelled(tree: Path, tmp_path: Path):
    archive = build("tar", tree, tmp_path / "data.tar")
    ctx = OpContext(root=tmp_path / "dest", progress=Progress())
    ctx.cancel.set()
    with pytest.raises(Cancelled):
        extract.run(ExtractStep(src=str(archive)), ctx)


@pytest.mark.parametrize("mode", ["w", "w:gz"])
def test_an_extraction_that_fails_early_leaves_no_thread_running(mode: str, tmp_path: Path):
    """gzip is decompressed ahead on a thread: an error that ends the extraction before
    the stream does (here an unsafe first member) stops it too. The archive is larger
    than what that thread may hold ahead (~10 MiB), so it would still be running."""
    archive = tmp_path / "data.tar"
    with tarfile.open(archive, mode, **({"compresslevel": 1} if "gz" in mode else {})) as tar:
        for name, data in (("../evil.txt", b"evil"), ("big.bin", os.urandom(24 << 20))):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    before = set(threading.enumerate())
    with pytest.raises(UnsafeArchiveMember) as raised:
        run_extract(archive, tmp_path / "dest")
    # Checked while the error is still held (its traceback keeps the extraction's
    # objects alive, as an error handler does): the thread must be stopped already.
    assert raised.traceback
    assert set(threading.enumerate()) - before == set()


def test_safe_links_inside_are_kept(tmp_path: Path):
    archive = tmp_path / "links.tar"
    with tarfile.open(archive, "w") as tar:
        data = b"payload"
        info = tarfile.TarInfo("d/file.txt")
        info.size, info.mtime = len(data), MTIME
        tar.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("d/alias")
        link.type, link.linkname, link.mtime = tarfile.SYMTYPE, "file.txt", MTIME
        tar.addfile(link)
        hard = tarfile.TarInfo("hard.txt")
        hard.type, hard.linkname = tarfile.LNKTYPE, "d/file.txt"
        tar.addfile(hard)
    dest = tmp_path / "dest"
    run_extract(archive, dest)
    assert os.readlink(dest / "d/alias") == "file.txt"
    assert (dest / "d/alias").read_bytes() == b"payload"
    assert (dest / "hard.txt").stat().st_ino == (dest / "d/file.txt").stat().st_ino
    assert int(os.lstat(dest / "d/alias").st_mtime) == MTIME
    run_extract(archive, dest)  # a re-run replaces the links it made
    assert time.time() > MTIME


@pytest.mark.parametrize("fmt", ["tar", "tar.gz"])
def test_extract_onto_another_filesystem(fmt: str, tree: Path, tmp_path: Path, tmpfs) -> None:
    """The everyday case: archive on the shared filesystem, data on local disk. The kernel
    refuses copy_file_range across filesystems (EXDEV); extraction must not."""
    archive = build(fmt, tree, tmp_path / f"data.{fmt}")
    dest = tmpfs("256m") / "root"
    run_extract(archive, dest)
    assert digest(dest) == digest(tree)


# -- verify ------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("size", ["small", "large"])
def test_sha256_reads_every_file_back(
    fmt: str, size: str, tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """verify sha256: a file whose bytes on disk differ from its member's is a failure
    naming it. The fault is injected below stager, where the bytes reach the disk."""
    archive = build(fmt, tree, tmp_path / f"data.{fmt}")
    run_extract(archive, tmp_path / "good", verify="sha256")  # the clean case passes
    assert digest(tmp_path / "good") == digest(tree)
    real_write = os.write
    bad = str(tmp_path / "bad")

    def flip_after_write(fd: int, data) -> int:  # noqa: ANN001 - os.write's signature
        done = real_write(fd, data)
        # Only the extracted files' data, small files (written from one read of the
        # archive per batch) or large ones (copied in chunks): corrupt the first byte
        # of what just landed.
        if (
            (0 < done < 65_000) == (size == "small")
            and done
            and os.readlink(f"/proc/self/fd/{fd}").startswith(bad)
        ):
            os.pwrite(fd, b"\0" if bytes(data[:1]) != b"\0" else b"\1", os.lseek(fd, 0, 1) - done)
        return done

    monkeypatch.setattr(os, "write", flip_after_write)
    monkeypatch.setattr(fastcopy, "_refused", set())  # what it learns here is forgotten after
    monkeypatch.setattr(os, "copy_file_range", lambda *a: _raise_enosys(), raising=False)
    monkeypatch.setattr(os, "sendfile", lambda *a: _raise_enosys(), raising=False)
    with pytest.raises(VerifyFailed, match=r"sha256 than its member in archive .*data\."):
        run_extract(archive, tmp_path / "bad", verify="sha256")


def _raise_enosys() -> int:
    raise OSError(errno.ENOSYS, "disabled by the test: bytes go through os.write")


def test_an_archive_rewritten_during_extraction_fails_naming_it(tmp_path: Path) -> None:
    """The archive's fstat (size, mtime, ctime) is compared after extraction: bytes
    from two versions of an archive are never reported as a dataset."""
    tree = tmp_path / "tree"
    for i in range(200):
        (tree / f"d{i % 4}").mkdir(parents=True, exist_ok=True)
        (tree / f"d{i % 4}" / f"f{i}.bin").write_bytes(os.urandom(2000))
    archive = build("tar", tree, tmp_path / "data.tar")

    class Rewriting(Progress):
        def advance(self, nbytes: int = 0, files: int = 0) -> None:
            super().advance(nbytes, files)
            if files and self.files_done >= 50 and not getattr(self, "done", False):
                self.done = True
                with open(archive, "r+b") as out:  # same size, new bytes in a member
                    out.seek(4096)
                    out.write(os.urandom(512))

    ctx = OpContext(root=tmp_path / "dest", progress=Rewriting(), workers=2)
    with pytest.raises(VerifyFailed, match=f"archive {archive} changed while it was being"):
        extract.run(ExtractStep(src=str(archive)), ctx)


def test_verify_none_skips_the_checks(tree: Path, tmp_path: Path) -> None:
    archive = build("tar", tree, tmp_path / "data.tar")
    run_extract(archive, tmp_path / "dest", verify="none")
    assert digest(tmp_path / "dest") == digest(tree)


def test_an_archive_reached_through_links_out_of_the_allowed_roots_is_refused(
    tree: Path, tmp_path: Path
) -> None:
    """Confinement holds for the archive path through any chain of links, also when the
    chain is changed after the request was checked (run opens, then checks the fd)."""
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    inside_archive = build("tar", tree, allowed / "ok.tar")
    outside_archive = build("tar", tree, outside / "secret.tar")
    (allowed / "hop2").symlink_to(inside_archive)
    (allowed / "hop1").symlink_to(allowed / "hop2")
    step = ExtractStep(src=str(allowed / "hop1"))
    roots = (allowed,)
    extract.check(step, CheckContext(allowed_roots=roots))  # inside: fine
    (allowed / "hop2").unlink()
    (allowed / "hop2").symlink_to(outside_archive)  # swapped after the check
    ctx = OpContext(root=tmp_path / "dest", progress=Progress(), allowed_roots=roots)
    with pytest.raises(UnsafePath, match=f"{allowed / 'hop1'} resolves to {outside_archive}"):
        extract.run(step, ctx)
    assert not (tmp_path / "dest").exists() or not any((tmp_path / "dest").iterdir())
    with pytest.raises(UnsafePath, match="outside the allowed source roots"):
        extract.check(step, CheckContext(allowed_roots=roots))
    fifo = allowed / "pipe.tar"
    os.mkfifo(fifo)
    with pytest.raises(SpecialSource, match="FIFO"):
        extract.run(ExtractStep(src=str(fifo)), ctx)  # never opened for reading: no hang


def test_the_imagenet_devkit_is_read_confined_too(tmp_path: Path) -> None:
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    devkit_file = outside / "ILSVRC2012_devkit_t12.tar.gz"
    with tarfile.open(devkit_file, "w:gz"):
        pass
    (allowed / "devkit.tar.gz").symlink_to(devkit_file)
    with pytest.raises(UnsafePath, match="outside the allowed source roots"):
        devkit.read_devkit(str(allowed / "devkit.tar.gz"), (allowed,))


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_extraction_counts_the_bytes_it_leaves(fmt: str, tree: Path, tmp_path: Path) -> None:
    """What a fresh tree is sealed with (stager.staging.worker): the bytes of the files and
    symlinks the extraction left, as a walk of the tree finds them, stripped or not.
    GNU tar's own shapes (appends, hard links, sparse files, replaced types) are held
    to the same in test_archive_compat."""
    (tree / "top/link").symlink_to("sub/deeper/c.jpg")
    os.link(tree / "top/big.bin", tree / "top/hard")
    archive = build(fmt, tree, tmp_path / f"data.{fmt}")
    for strip in (0, 2):
        dest = tmp_path / f"dest-{strip}"
        step = ExtractStep(src=str(archive), strip_components=strip)
        made = extract.run(step, OpContext(root=dest, progress=Progress(), workers=2))
        assert made == sum_sizes(str(dest)) > 0, strip


@pytest.mark.parametrize("outer", ["tar", "tar.gz", "zip"])
def test_an_extraction_of_inner_archives_leaves_its_tree_to_be_measured(
    outer: str, tmp_path: Path
) -> None:
    """Inner archives write under folders the outer one may fill or replace meanwhile,
    so their count is not kept: None, and the staging measures the tree (its seal is
    held to a full walk in test_seal). ``nested`` without an archive inside counts."""
    inner_dir = tmp_path / "inner"
    (inner_dir / "class").mkdir(parents=True)
    (inner_dir / "class/x.txt").write_bytes(b"x" * 1000)
    plain = build(outer, inner_dir, tmp_path / f"plain.{outer}")
    build("tar", make_tree(tmp_path / "tree") / "top", inner_dir / "n01440764.tar")
    nested = build(outer, inner_dir, tmp_path / f"outer.{outer}")
    for archive, expected in ((nested, None), (plain, 1000)):
        dest = tmp_path / f"dest-{archive.stem}"
        step = ExtractStep(src=str(archive), nested=True)
        made = extract.run(step, OpContext(root=dest, progress=Progress(), workers=2))
        assert made == expected, archive
        if made is None:
            assert (dest / "n01440764/a.txt").read_bytes() == b"alpha\n"


def test_what_a_member_replaces_is_taken_off_the_count(tmp_path: Path) -> None:
    """A leftover folder (files, a link to a folder, a sub-folder) under a member's
    name is removed, and its bytes, counted as a walk counts them, come off."""
    dest = tmp_path / "dest"
    (dest / "x/sub").mkdir(parents=True)
    (dest / "x/sub/f").write_bytes(b"12345")
    (dest / "x/to-sub").symlink_to("sub")
    (dest / "kept").write_bytes(b"kept")
    before = sum_sizes(str(dest))
    archive = tmp_path / "a.tar"
    with tarfile.open(archive, "w") as tar:
        member = tarfile.TarInfo("x")
        member.size = 3
        tar.addfile(member, io.BytesIO(b"abc"))
    made = extract.run(ExtractStep(src=str(archive)), OpContext(root=dest, progress=Progress()))
    assert (dest / "x").read_bytes() == b"abc"
    assert made == sum_sizes(str(dest)) - before == 3 - 5 - len("sub")


@pytest.mark.parametrize("depth", [100, 3000])
def test_a_member_whose_path_is_longer_than_a_path_may_be_is_refused(
    depth: int, tmp_path: Path
) -> None:
    """A pax name of ``depth`` folders and past 4095 bytes: no tool could open or delete
    it by its name (a 100,000-folder one was left undeletable in the cache), so it is
    refused before anything is made, in a tree and in an image alike."""
    name = "/".join(["d" * (4200 // depth + 1)] * depth) + "/f"
    archive = tmp_path / "deep.tar"
    with tarfile.open(archive, "w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo(name)
        info.size = 2
        tar.addfile(info, io.BytesIO(b"hi"))
    with pytest.raises(UnsafeArchiveMember, match="past the 4095 a path may have"):
        run_extract(archive, tmp_path / "out")
    assert not any((tmp_path / "out").rglob("f"))
    from stager.image.build import build_image

    with pytest.raises(UnsafeArchiveMember, match="past the 4095 a path may have"):
        build_image(str(archive), str(tmp_path / "out.erofs"))


def test_a_range_of_a_path_longer_than_a_path_may_be_is_refused() -> None:
    from stager.archive import ranges

    with pytest.raises(VerifyFailed, match="a range of a path no sender writes"):
        ranges._relative("a/" * 100_000 + "x", "part 0")
    assert ranges._relative("a/" * 2000 + "x", "part 0")  # 4001 bytes: a path may be
