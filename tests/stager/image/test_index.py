"""Index images (a plain tar kept whole as the blob, an image of its metadata only)
built from real archives, mounted by the kernel with the blob as the extra device, and
read back entry by entry and byte by byte against GNU tar's extraction; and the same
with the tar embedded in the image (one file, mounted as any image): ``layout``."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from stager.archive.formats import sniff
from stager.core.errors import CorruptArchive, UnknownFormat, UnsafeArchiveMember
from stager.image import mount as image_mount
from stager.image.build import BuildOptions
from stager.image.erofs import EMBEDDED_AT
from stager.image.index import SourceChanged, build_indexed
from tests import tar_corpus
from tests.stager.image.test_build import CASES, _odd_tree, built_alone


@pytest.fixture(params=["blob", "embedded"])
def layout(request: pytest.FixtureRequest) -> str:
    return request.param


def _indexed(
    archive: Path, tmp: Path, options: BuildOptions | None = None, layout: str = "blob"
) -> tuple[Path, Path | None]:
    image, blob = tmp / f"{archive.name}.erofs", tmp / f"{archive.name}.blob"
    embedded = layout == "embedded"
    build_indexed(str(archive), None if embedded else str(blob), str(image), options)
    return image, None if embedded else blob


def _holds_the_tar(image: Path, blob: Path | None, archive: Path) -> None:
    """The tar's bytes, whole: the blob, or the embedded copy in the image."""
    data = archive.read_bytes()
    if blob is not None:
        assert blob.read_bytes() == data
    else:
        with open(image, "rb") as held:
            held.seek(EMBEDDED_AT)
            assert held.read(len(data)) == data


def _plain(archive: Path) -> bool:
    with open(archive, "rb") as head:
        return sniff(head.read(512)) == "tar"


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_corpus_reads_back_as_gnu_tar_extracts_it(
    name: str, tmp_path: Path, kernel_mount, layout: str
) -> None:
    case, archives = built_alone(name, tmp_path / "work")
    out = tmp_path / "out"
    out.mkdir()
    if not _plain(archives[0]):
        with pytest.raises(UnknownFormat, match="not a plain tar"):
            _indexed(archives[0], out, layout=layout)
        assert not list(out.iterdir())
        return
    reference = tmp_path / "reference"
    started = int(time.time())
    failed = tar_corpus.reference_extract(case, archives, reference)
    if case.refusal is not None:
        assert failed is not None
        errors = (UnsafeArchiveMember, UnknownFormat, CorruptArchive)
        with pytest.raises(errors, match=case.refusal):
            _indexed(archives[0], out, layout=layout)
        assert not list(out.iterdir()), "a refused build leaves neither image nor blob"
        return
    assert failed is None, failed
    image, blob = _indexed(archives[0], out, layout=layout)
    _holds_the_tar(image, blob, archives[0])
    mounted = kernel_mount(image, "file", blob)
    found, expected = tar_corpus.snapshot(mounted), tar_corpus.snapshot(reference)
    for rel, entry in expected.items():
        if entry[0] == "dir" and entry[1] >= started and found.get(rel, ("dir",))[0] == "dir":
            found[rel] = entry  # tar -u/-r: see test_build's test of the same name
    assert found == expected


@pytest.mark.parametrize("fmt", ["gnu", "posix", "ustar"])
def test_generated_trees_read_back_byte_for_byte(
    fmt: str, tmp_path: Path, kernel_mount, layout: str
) -> None:
    tree = tmp_path / "src"
    if fmt == "ustar":  # ustar holds no long names
        tar_corpus.basic_tree(tree)
    else:
        _odd_tree(tree)
    archive = tmp_path / "a.tar"
    tar_corpus.gnu_tar("-cf", archive, f"--format={fmt}", "-C", tree, ".")
    reference = tmp_path / "reference"
    reference.mkdir()
    tar_corpus.gnu_tar("--no-same-owner", "-xf", archive, "-C", reference)
    image, blob = _indexed(archive, tmp_path, layout=layout)
    mounted = kernel_mount(image, "loop" if blob is None else "file", blob)
    assert tar_corpus.snapshot(mounted) == tar_corpus.snapshot(reference)
    # Metadata only: the content stays in the blob (a sparse member's would not).
    size = os.path.getsize(image) - (
        0 if blob is not None else EMBEDDED_AT + archive.stat().st_size
    )
    assert size < os.path.getsize(archive) // 4


def test_edge_sizes_and_names_map_to_the_blob(tmp_path: Path, kernel_mount, layout: str) -> None:
    write = tar_corpus._write  # noqa: SLF001 - the corpus's own writer
    tree = tmp_path / "src"
    for size in (0, 1, 511, 512, 513, 4095, 4096, 4097, 3 * 4096, 1_000_001):
        write(tree / "sizes" / f"f{size}", os.urandom(size))
    write(tree.joinpath(*["n" * 200, "m" * 255]) / "deep", b"long names")
    os.symlink("../sizes/f512", tree / "sizes" / "up")
    os.symlink("t" * 1000, tree / "long-target")
    tar_corpus._settle_dirs(tree)  # noqa: SLF001
    archive = tmp_path / "edges.tar"
    tar_corpus.gnu_tar("-cf", archive, "-C", tree, ".")
    image, blob = _indexed(archive, tmp_path, layout=layout)
    mounted = kernel_mount(image, "file", blob)
    assert tar_corpus.snapshot(mounted) == tar_corpus.snapshot(tree)


def test_a_compressed_tar_is_refused_with_what_to_do(tmp_path: Path) -> None:
    tree = tar_corpus.basic_tree(tmp_path / "src")
    archive = tmp_path / "a.tar.gz"
    tar_corpus.gnu_tar("-czf", archive, "-C", tree, ".")
    with pytest.raises(UnknownFormat, match="not a plain tar.*ordinary image"):
        _indexed(archive, tmp_path / "src")


def test_a_truncated_archive_fails_and_leaves_nothing(tmp_path: Path, layout: str) -> None:
    tree = tar_corpus.basic_tree(tmp_path / "src")
    archive = tmp_path / "cut.tar"
    tar_corpus.gnu_tar("-cf", archive, "-C", tree, ".")
    with open(archive, "r+b") as cut:
        cut.truncate(os.path.getsize(archive) // 2)
    with pytest.raises(Exception, match="cut short|ended|corrupt"):
        _indexed(archive, tmp_path, layout=layout)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.tar", "src"]


class _Toucher:
    """A progress sink that writes to the source mid-build, as someone else might."""

    def __init__(self, archive: Path) -> None:
        self.archive = archive

    def add_total(self, nbytes: int = 0, files: int = 0) -> None:
        pass

    def advance(self, nbytes: int = 0, files: int = 0) -> None:
        os.utime(self.archive, (1, 1))


def test_a_source_changed_meanwhile_fails_and_leaves_nothing(tmp_path: Path, layout: str) -> None:
    tree = tar_corpus.basic_tree(tmp_path / "src")
    archive = tmp_path / "a.tar"
    tar_corpus.gnu_tar("-cf", archive, "-C", tree, ".")
    options = BuildOptions(progress=_Toucher(archive))  # type: ignore[arg-type]
    with pytest.raises(SourceChanged, match="changed while it was copied"):
        _indexed(archive, tmp_path, options, layout)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.tar", "src"]


def _loops_over(*paths: Path) -> list[str]:
    """The loop devices whose backing file is one of ``paths``."""
    wanted = {str(p) for p in paths}
    found = []
    for entry in Path("/sys/block").glob("loop*"):
        backing = entry / "loop" / "backing_file"
        if backing.exists() and backing.read_text().strip() in wanted:
            found.append(entry.name)
    return found


def test_through_loop_devices_as_a_kernel_before_6_12_would(tmp_path: Path, kernel_mount) -> None:
    """The image and its blob each behind a read-only loop device (the kernel opens an
    extra device as a file only when the image is mounted from its file); both loop
    devices are freed by the kernel at the unmount."""
    tree = _odd_tree(tmp_path / "src")
    archive = tmp_path / "a.tar"
    tar_corpus.gnu_tar("-cf", archive, "-C", tree, ".")
    image, blob = _indexed(archive, tmp_path)
    mounted = kernel_mount(image, "loop", blob)
    assert len(_loops_over(image, blob)) == 2
    assert image_mount.mounted_at(str(mounted)).source.startswith("/dev/loop")  # type: ignore[union-attr]
    reference = tmp_path / "reference"
    reference.mkdir()
    tar_corpus.gnu_tar("--no-same-owner", "-xf", archive, "-C", reference)
    assert tar_corpus.snapshot(mounted) == tar_corpus.snapshot(reference)
    image_mount.unmount(str(mounted))
    assert _loops_over(image, blob) == []


def test_a_blob_path_with_a_comma_is_refused_before_the_kernel_sees_it(
    tmp_path: Path, kernel_mount
) -> None:
    tree = tar_corpus.basic_tree(tmp_path / "src")
    archive = tmp_path / "a.tar"
    tar_corpus.gnu_tar("-cf", archive, "-C", tree, ".")
    image, blob = tmp_path / "a.erofs", tmp_path / "a,b.blob"
    build_indexed(str(archive), str(blob), str(image))
    with pytest.raises(image_mount.MountError, match="comma"):
        kernel_mount(image, "file", blob)


def test_a_private_copy_s_blob_is_as_closed_as_its_image(tmp_path: Path, kernel_mount) -> None:
    """The node service's private copy: image and blob 0400 (root's; the user reads
    through the mount only), the top folder the user's, 0500."""
    tree = tar_corpus.basic_tree(tmp_path / "src")
    archive = tmp_path / "a.tar"
    tar_corpus.gnu_tar("-cf", archive, "-C", tree, ".")
    options = BuildOptions(mode=0o400, top_owner=4321)
    image, blob = _indexed(archive, tmp_path, options)
    assert (image.stat().st_mode & 0o777, blob.stat().st_mode & 0o777) == (0o400, 0o400)
    mounted = kernel_mount(image, "file", blob)
    top = mounted.stat()
    assert (top.st_uid, top.st_mode & 0o777) == (4321, 0o500)


@pytest.mark.parametrize(("files", "size"), [(40, 1 << 20), (200, 200_000), (3000, 3000)])
def test_headers_are_read_only_where_the_copy_has_been(
    files: int, size: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An index build reads a window of headers only once the blob's copy is past it
    (from the page cache the copy just filled, one stream from a cold disk): members
    of any size, whether a run of small files or one bigger than a run."""
    import io
    import tarfile

    from stager.archive import tar_members
    from stager.image import index

    archive = tmp_path / "members.tar"
    with tarfile.open(archive, "w", format=tarfile.USTAR_FORMAT) as tar:
        for k in range(files):
            info = tarfile.TarInfo(f"d/f{k}")
            info.size = size
            tar.addfile(info, io.BytesIO(os.urandom(size)))
    copied: list[int] = []  # where the copy was at each check
    ahead: list[tuple[int, int, int]] = []  # reads of headers past it
    check, pread = index._Following.check, os.pread

    def following(self: index._Following) -> None:
        check(self)
        copied.append(self._copy.copied)

    def read(fd: int, count: int, offset: int) -> bytes:
        if copied and copied[-1] < offset + count:
            ahead.append((offset, count, copied[-1]))
        return pread(fd, count, offset)

    monkeypatch.setattr(index._Following, "check", following)
    monkeypatch.setattr(tar_members.os, "pread", read)
    build_indexed(str(archive), None, str(tmp_path / "i.img"), BuildOptions(sync=False))
    assert copied, "the header reader never waited for the copy"
    assert ahead == [], f"headers read past the copy (offset, count, copied): {ahead[:3]}"
