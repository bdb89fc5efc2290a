"""Images built from real archives, mounted by the kernel, read back entry by entry and
byte by byte against GNU tar's extraction of the same archive."""

from __future__ import annotations

import io
import itertools
import os
import re
import shutil
import stat
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from stager.core.errors import Cancelled, CorruptArchive, UnknownFormat, UnsafeArchiveMember
from stager.image import names as image_names
from stager.image.build import BuildOptions, Names, build_image
from stager.image.erofs import BLOCK, ErofsWriter
from stager.image.index import build_indexed
from stager.wire.progress import Progress
from tests import tar_corpus

Mount = Callable[[Path], Path]

# Cases of one tar each (an image is built from one stream), small enough for a test:
# the 8 GiB sparse file and the numbers past octal fields are gigabytes of zeros.
_TOO_BIG = {"gnu-tar-sparse-8gib", "gnu-tar-big-numbers-gnu", "gnu-tar-big-numbers-posix"}
CASES = {
    name: case
    for name, case in tar_corpus.CASES.items()
    if case.reference == "tar" and name not in _TOO_BIG
}


def _image_of(archive: Path, tmp: Path, **names: object) -> Path:
    image = tmp / f"{archive.name}.erofs"
    build_image(str(archive), str(image), BuildOptions(names=Names(**names)))  # type: ignore[arg-type]
    return image


def _fsck(image: Path) -> None:
    if shutil.which("fsck.erofs"):
        done = subprocess.run(["fsck.erofs", str(image)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr or done.stdout


def built_alone(name: str, work: Path) -> tuple[tar_corpus.Case, list[Path]]:
    """The corpus case ``name`` and its archive, built in ``work``; skipped where its
    tools are missing or it is more than one archive (an image is built from one)."""
    case = CASES[name]
    if missing := tar_corpus.missing_tools(case):
        pytest.skip(f"needs {missing}")
    work.mkdir()
    archives = case.build(work)
    if len(archives) != 1:
        pytest.skip("extracted from several archives in turn; an image is built from one")
    return case, archives


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_corpus_reads_back_as_gnu_tar_extracts_it(
    name: str, tmp_path: Path, kernel_mount: Mount
) -> None:
    case, archives = built_alone(name, tmp_path / "work")
    reference = tmp_path / "reference"
    started = int(time.time())
    failed = tar_corpus.reference_extract(case, archives, reference)
    if case.refusal is not None:
        assert failed is not None
        with pytest.raises(
            (UnsafeArchiveMember, UnknownFormat, CorruptArchive), match=case.refusal
        ):
            _image_of(archives[0], tmp_path)
        assert not list(tmp_path.glob("*.erofs*")), "a refused build leaves nothing"
        return
    assert failed is None, failed
    image = _image_of(archives[0], tmp_path)
    _fsck(image)
    mounted = kernel_mount(image)
    found, expected = tar_corpus.snapshot(mounted), tar_corpus.snapshot(reference)
    for rel, entry in expected.items():
        if entry[0] == "dir" and entry[1] >= started and found.get(rel, ("dir",))[0] == "dir":
            # GNU tar sets a folder's time when it leaves it; members appended to it later
            # (tar -u/-r) leave the time of extraction there, not the archive's.
            found[rel] = entry
    assert found == expected


def _odd_tree(root: Path) -> Path:
    """Names and shapes an image writer can get wrong: block-edge sizes, empty files,
    odd bytes in names, long names, a deep tree, a wide folder, links."""
    write = tar_corpus._write  # noqa: SLF001 - the corpus's own writer
    for size in (0, 1, 511, 512, BLOCK - 65, BLOCK - 64, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK):
        write(root / "sizes" / f"f{size}", os.urandom(size))
    write(root / "sizes" / "big", os.urandom(300_000))
    for name in ("sp ace", "tab\there", "new\nline", "-dash", "ünïcödé", "日本語", "#!$%&'()"):
        write(root / "names" / name, name.encode())
    write(root / "names" / ("L" * 255), b"longest component")
    write(root.joinpath(*[f"d{i}" for i in range(60)]) / "deep.txt", b"deep")
    for i in range(700):  # a folder of several entry blocks
        write(root / "wide" / f"entry-{i:04d}-{'w' * (i % 40)}", str(i).encode())
    os.link(root / "sizes" / "big", root / "hard-big")
    os.link(root / "names" / "日本語", root / "wide" / "hard-nihongo")
    os.symlink("../sizes/f1", root / "names" / "link-up")
    os.symlink("x" * 3000, root / "long-dangling-link")
    for link in ("names/link-up", "long-dangling-link"):
        os.utime(root / link, (tar_corpus.MTIME,) * 2, follow_symlinks=False)
    (root / "empty-folder").mkdir()
    tar_corpus._settle_dirs(root)  # noqa: SLF001
    return root


@pytest.mark.parametrize(
    ("fmt", "compress"),
    [("gnu", ""), ("posix", ""), ("posix", "gzip"), ("gnu", "zstd"), ("ustar", "xz")],
)
def test_generated_trees_read_back_byte_for_byte(
    fmt: str, compress: str, tmp_path: Path, kernel_mount: Mount
) -> None:
    if compress and shutil.which(compress) is None:
        pytest.skip(f"needs {compress}")
    if fmt == "ustar":  # ustar holds no long names: the tree without them
        tree = tmp_path / "src"
        tar_corpus.basic_tree(tree)
    else:
        tree = _odd_tree(tmp_path / "src")
    archive = tmp_path / ("a.tar" + {"": "", "gzip": ".gz", "zstd": ".zst", "xz": ".xz"}[compress])
    flags = [f"--format={fmt}"] + ([f"--use-compress-program={compress}"] if compress else [])
    tar_corpus.gnu_tar("-cf", archive, *flags, "-C", tree, ".")
    reference = tmp_path / "reference"
    reference.mkdir()
    tar_corpus.gnu_tar("--no-same-owner", "-xf", archive, "-C", reference)
    image = _image_of(archive, tmp_path)
    _fsck(image)
    mounted = kernel_mount(image)
    assert tar_corpus.snapshot(mounted) == tar_corpus.snapshot(reference)
    assert os.stat(image).st_mode & 0o777 == 0o444


def test_names_are_stripped_placed_and_renamed_as_a_recipe_would(
    tmp_path: Path, kernel_mount: Mount
) -> None:
    tree = tmp_path / "src" / "inat"
    tar_corpus._write(tree / "train" / "00000_Animalia" / "a.jpg", b"a")  # noqa: SLF001
    tar_corpus._write(tree / "val" / "00000_Animalia" / "b.jpg", b"b")  # noqa: SLF001
    archive = tmp_path / "inat.tar"
    tar_corpus.gnu_tar("-cf", archive, "-C", tmp_path / "src", "inat")
    image = _image_of(
        archive, tmp_path, strip=1, into="data", renames=(("data/train", "data/2021_train"),)
    )
    mounted = kernel_mount(image)
    assert (mounted / "data" / "2021_train" / "00000_Animalia" / "a.jpg").read_bytes() == b"a"
    assert (mounted / "data" / "val" / "00000_Animalia" / "b.jpg").read_bytes() == b"b"
    assert sorted(os.listdir(mounted / "data")) == ["2021_train", "val"]


def test_a_tree_is_packed_from_its_listing(tmp_path: Path, kernel_mount: Mount) -> None:
    tree = _odd_tree(tmp_path / "src")
    image = tmp_path / "tree.erofs"
    progress = Progress()
    built = build_image(str(tree), str(image), BuildOptions(progress=progress))
    assert built.files == progress.files_done == 724  # hard links are files in a walk
    mounted = kernel_mount(image)
    assert tar_corpus.snapshot(mounted) == tar_corpus.snapshot(tree)


def test_an_image_written_inside_the_folder_it_packs_leaves_itself_out(
    tmp_path: Path, kernel_mount: Mount
) -> None:
    """``stager image build DIR -o DIR/x.erofs`` packed its own partial image and its
    spill (5 files for 3); built again, it would pack the first image too. The build's
    own files are left out by identity, as mksquashfs leaves its output out, whatever
    the path that names them; the image holds exactly the tree."""
    tree = tmp_path / "src"
    for i in range(3):
        (tree / "d").mkdir(parents=True, exist_ok=True)
        (tree / "d" / f"{i}.txt").write_text(str(i))
    (tmp_path / "alias").symlink_to(tree)  # the output named through a link
    for output, files, replaced in (
        (tree / "x.erofs", 3, ""),
        (tree / "x.erofs", 3, "x.erofs"),  # the older image of that name: replaced
        (tmp_path / "alias" / "d" / "y.erofs", 4, ""),  # x.erofs is data now
    ):
        expected = tar_corpus.snapshot(tree)
        expected.pop(replaced, None)
        built = build_image(str(tree), str(output))
        assert built.files == files, f"{output}: {built.files} files"
        found = tar_corpus.snapshot(kernel_mount(output))
        if output.parent.name == "d":  # its own files moved d's mtime while it was walked
            found["d"], expected["d"] = found["d"][:1], expected["d"][:1]
        assert found == expected


def test_every_file_is_read_only_and_roots_whatever_the_archive_says(
    tmp_path: Path, kernel_mount: Mount
) -> None:
    archive = tmp_path / "modes.tar"
    with tarfile.open(archive, "w") as tar:
        for name, mode in (("setuid", 0o4777), ("private", 0o600), ("exec", 0o755)):
            info = tarfile.TarInfo(name)
            info.mode, info.uid, info.gid, info.size = mode, 1234, 5678, 1
            tar.addfile(info, __import__("io").BytesIO(b"x"))
        folder = tarfile.TarInfo("open-folder")
        folder.type, folder.mode = tarfile.DIRTYPE, 0o1777
        tar.addfile(folder)
    mounted = kernel_mount(_image_of(archive, tmp_path))
    for name in ("setuid", "private", "exec"):
        st = os.stat(mounted / name)
        assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o444, 0, 0)
    assert stat.S_IMODE(os.stat(mounted / "open-folder").st_mode) == 0o555
    with pytest.raises(OSError, match="Read-only file system"):
        (mounted / "new").write_bytes(b"no")


def _tar_with(tmp_path: Path, *members: tarfile.TarInfo) -> Path:
    archive = tmp_path / "unsafe.tar"
    with tarfile.open(archive, "w", format=tarfile.GNU_FORMAT) as tar:
        for member in members:
            data = b"x" * member.size if member.isreg() else None
            tar.addfile(member, __import__("io").BytesIO(data) if data is not None else None)
    return archive


def _member(name: str, kind: bytes = tarfile.REGTYPE, linkname: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, linkname
    info.size = 1 if kind == tarfile.REGTYPE else 0
    return info


@pytest.mark.parametrize(
    ("members", "why"),
    [
        ([_member("/etc/passwd")], "absolute path"),
        ([_member("a/../../escape")], "'..' component"),
        ([_member("dev", tarfile.CHRTYPE)], "a device file or FIFO"),
        ([_member("fifo", tarfile.FIFOTYPE)], "a device file or FIFO"),
        ([_member("up", tarfile.SYMTYPE, "../../etc")], "outside the destination"),
        ([_member("abs", tarfile.SYMTYPE, "/etc/shadow")], "absolute"),
        ([_member("hard", tarfile.LNKTYPE, "../x")], "'..' component"),
        ([_member("hard", tarfile.LNKTYPE, "missing")], "no earlier member wrote"),
        (
            [_member("d", tarfile.SYMTYPE, "sub/../sub"), _member("d/under")],
            "GNU tar does not write through it either",
        ),
    ],
)
def test_unsafe_members_are_refused_and_nothing_is_left(
    members: list[tarfile.TarInfo], why: str, tmp_path: Path
) -> None:
    archive = _tar_with(tmp_path, _member("fine"), *members)
    image = tmp_path / "out.erofs"
    with pytest.raises(UnsafeArchiveMember, match=re.escape(why)):
        build_image(str(archive), str(image))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["unsafe.tar"]


@pytest.mark.parametrize(
    ("kind", "why"), [(b"N", "obsolete GNU 'names' member"), (b"M", "starts in another volume")]
)
def test_members_extraction_refuses_by_type_are_refused_alike(
    kind: bytes, why: str, tmp_path: Path
) -> None:
    """One rule with extraction (tar_reader.skipped): a GNU 'names' member was once
    written into the image as a file."""
    archive = _tar_with(tmp_path, _member("fine"), _member("odd", kind))
    with pytest.raises(UnknownFormat, match=re.escape(why)):
        build_image(str(archive), str(tmp_path / "out.erofs"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["unsafe.tar"]


def test_a_truncated_archive_fails_and_leaves_nothing(tmp_path: Path) -> None:
    tree = tmp_path / "src"
    tar_corpus.basic_tree(tree)
    archive = tmp_path / "cut.tar"
    tar_corpus.gnu_tar("-cf", archive, "-C", tree, ".")
    with open(archive, "r+b") as cut:
        cut.truncate(os.path.getsize(archive) // 2)
    with pytest.raises(Exception, match="cut short|ended|corrupt"):
        build_image(str(archive), str(tmp_path / "out.erofs"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.tar", "src"]


def test_the_same_archive_makes_the_same_image(tmp_path: Path) -> None:
    tree = _odd_tree(tmp_path / "src")
    archive = tmp_path / "a.tar"
    tar_corpus.gnu_tar("-cf", archive, "-C", tree, ".")
    first = _image_of(archive, tmp_path)
    again = tmp_path / "again.erofs"
    build_image(str(archive), str(again))
    assert first.read_bytes() == again.read_bytes()


def test_a_build_killed_midway_leaves_nothing_that_stops_the_next(tmp_path: Path) -> None:
    """kill -9 during a build leaves OUTPUT.partial and the spill; neither is the image,
    and the next build starts over past them."""
    archive = make_small_tar_for_test(tmp_path / "many.tar", 60_000)
    image = tmp_path / "many.erofs"
    script = (
        "import sys; from stager.image.build import build_image; "
        "build_image(sys.argv[1], sys.argv[2])"
    )
    child = subprocess.Popen([sys.executable, "-c", script, str(archive), str(image)])
    deadline = time.monotonic() + 60
    while not Path(str(image) + ".spill").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)  # mid-way: 60,000 members take a second or more
    child.kill()
    child.wait()
    assert not image.exists(), "a killed build never carries the image's name"
    built = build_image(str(archive), str(image))
    assert built.files == 60_000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["many.erofs", "many.tar"]


def test_a_durable_build_starts_its_writeback_as_it_goes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A durable build (``sync``, as every staging's) starts the writeback of each
    stretch of data it wrote, in order and without a gap, so that its fsync finds
    little left; a build that does not fsync leaves writeback to the kernel."""
    started: list[tuple[int, int]] = []
    monkeypatch.setattr(image_names, "start_writeback", lambda fd, at, n: started.append((at, n)))
    tree = tmp_path / "src"
    tree.mkdir()
    for i in range(12):
        (tree / f"f{i}.bin").write_bytes(os.urandom(4 << 20))
    archive = tmp_path / "big.tar"
    tar_corpus.gnu_tar("-cf", archive, "-C", tree, ".")

    build_image(str(archive), str(tmp_path / "durable.erofs"), BuildOptions(sync=True))
    assert len(started) >= 2, started
    assert started[0][0] == 0
    assert all(at + n == after for (at, n), (after, _) in itertools.pairwise(started)), started
    assert all(n >= image_names._WRITEBACK_STEP for _, n in started)
    assert sum(n for _, n in started) > 48 * 2**20 - image_names._WRITEBACK_STEP

    started.clear()
    build_image(str(archive), str(tmp_path / "plain.erofs"), BuildOptions(sync=False))
    assert started == []


def test_an_image_file_is_truncated_only_when_it_holds_something(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On ext4 a truncate to 0, even of an empty file, makes its close wait for all its
    writeback: a new image file is not truncated; one with old bytes in it is, and the
    image written into it is the same."""
    cuts: list[int] = []
    real_ftruncate = os.ftruncate

    def ftruncate(fd: int, length: int) -> None:
        cuts.append(length)
        real_ftruncate(fd, length)

    monkeypatch.setattr(os, "ftruncate", ftruncate)

    def image_in(path: Path) -> bytes:
        fd = os.open(path, os.O_RDWR | os.O_CREAT)
        try:
            writer = ErofsWriter(fd, str(path) + ".spill")
            data = io.BytesIO(b"hello\n" * 1000)
            writer.file_stream(writer.folder("d"), "a.txt", 6000, 0, data.read)
            writer.finish()
        finally:
            os.close(fd)
        return path.read_bytes()

    fresh = image_in(tmp_path / "fresh.erofs")
    assert 0 not in cuts
    used = tmp_path / "used.erofs"
    used.write_bytes(os.urandom(1 << 20))
    assert image_in(used) == fresh
    assert cuts.count(0) == 1


class _Sink:
    """A staging's progress as a build tells it: members, archive bytes, bytes written."""

    def __init__(self) -> None:
        self.files = self.done = self.written = 0

    def add_total(self, nbytes: int = 0, files: int = 0) -> None:
        pass

    def advance(self, nbytes: int = 0, files: int = 0) -> None:
        self.done += nbytes
        self.files += files

    def wrote(self, nbytes: int, inodes: int = 0) -> None:
        self.written += nbytes


@pytest.mark.parametrize("fmt", ["erofs", "squashfs"])
def test_a_tars_runs_of_small_files_are_counted_whole_and_a_cancel_stops_them(
    fmt: str, tmp_path: Path
) -> None:
    """A plain tar's files go to the writer in runs of one folder: every member and
    byte is still counted, their content charged, and the build's check (a cancel) runs
    while the headers are read, not only at the start."""
    archive = tmp_path / "runs.tar"
    sizes = [100 + i % 7 for i in range(3000)]
    with tarfile.open(archive, "w", format=tarfile.USTAR_FORMAT) as tar:
        for i, size in enumerate(sizes):
            info = tarfile.TarInfo(f"d{i // 1000}/f{i:05d}")
            info.size = size
            tar.addfile(info, io.BytesIO(b"x" * size))
    sink = _Sink()
    options = BuildOptions(format=fmt, progress=sink, sync=False)
    built = build_indexed(str(archive), None, str(tmp_path / "whole.img"), options).image
    assert built.files == sink.files == 3000
    assert sink.done == os.path.getsize(archive)
    assert sink.written >= sum(sizes)  # the content, and the metadata charged besides

    looks = itertools.count()

    def check() -> None:
        if next(looks) == 3:
            raise Cancelled("staging was cancelled")

    image = tmp_path / "cancelled.img"
    with pytest.raises(Cancelled):
        build_indexed(str(archive), None, str(image), BuildOptions(format=fmt, check=check))
    assert not image.exists()


@pytest.mark.parametrize("fmt", ["erofs", "squashfs"])
def test_a_cancel_is_looked_at_before_each_member_outside_a_run(fmt: str, tmp_path: Path) -> None:
    """A sparse member spans a few blocks of the archive and writes its holes whole (an
    image holds no holes): dozens fit in one window of headers, so the build's check
    (a cancel) runs before each such member, not only before each window."""
    tree = tmp_path / "sparse"
    tree.mkdir()
    members = 12
    for k in range(members):
        with open(tree / f"s{k}", "wb") as f:
            f.truncate(4 << 20)
            f.write(b"x")
    archive = tmp_path / "sparse.tar"
    subprocess.run(
        ["tar", "--sparse", "--format=gnu", "-cf", str(archive), "-C", str(tree), "."],
        check=True,
    )
    assert os.path.getsize(archive) < 64 << 10  # every header in one window
    looks = itertools.count(1)
    options = BuildOptions(format=fmt, check=lambda: next(looks), sync=False)
    build_indexed(str(archive), None, str(tmp_path / "sparse.img"), options)
    assert next(looks) > members, "a member outside a run was written without a check"


@pytest.mark.parametrize("fmt", ["erofs", "squashfs"])
def test_a_compressed_tar_is_looked_at_once_a_member(fmt: str, tmp_path: Path) -> None:
    """A stream's member loop (tar_members.members) looks before each header it reads,
    so before each member: the build looked again before writing it, twice a member."""
    archive = tmp_path / "members.tar.gz"
    members = 40
    with tarfile.open(archive, "w:gz") as tar:
        for i in range(members):
            info = tarfile.TarInfo(f"d/f{i:03d}")
            info.size = 10
            tar.addfile(info, io.BytesIO(b"x" * 10))
    looks = itertools.count()
    options = BuildOptions(format=fmt, check=lambda: next(looks), sync=False)
    build_image(str(archive), str(tmp_path / "members.img"), options)
    # Before the first header, and before each next one (the last: the end marker).
    assert next(looks) == members + 1


def make_small_tar_for_test(path: Path, files: int) -> Path:
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        for i in range(files):
            info = tarfile.TarInfo(f"c{i % 10}/f{i:06d}")
            info.size = 100
            tar.addfile(info, io.BytesIO(bytes([i % 256]) * 100))
    return path
