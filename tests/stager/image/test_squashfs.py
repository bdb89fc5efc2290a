"""stager's squashfs writer (stager.image.squashfs) against the real readers: each image
is unpacked by ``unsquashfs`` (squashfs-tools) and mounted by ``squashfuse_ll`` as a
user, and must give what ``tar -xf`` of the same archive gives: names, bytes, link
targets, hard-link identity, times, with the image's modes (files 0444, folders 0555).
Both ways a tar is written into an image are read: each member's data copied in, and
the whole plain tar embedded with the files pointing into it."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from stager.archive.formats import sniff
from stager.core.errors import CorruptArchive, UnknownFormat, UnsafeArchiveMember
from stager.image import squashfs
from stager.image.build import BuildOptions, build_image
from stager.image.index import build_indexed
from tests import tar_corpus
from tests.stager.image.test_build import CASES, built_alone
from tests.users import User

pytestmark = pytest.mark.skipif(
    shutil.which("unsquashfs") is None, reason="needs unsquashfs (Debian: squashfs-tools)"
)


def _images(archive: Path, tmp: Path) -> dict[str, Path]:
    """The archive's image written both ways: members copied, and (a plain tar) embedded."""
    made = {"copied": tmp / f"{archive.name}.sqfs"}
    build_image(str(archive), str(made["copied"]), BuildOptions(format="squashfs"))
    if sniff(archive.read_bytes()[:512]) == "tar":
        made["embedded"] = tmp / f"{archive.name}.embedded.sqfs"
        build_indexed(str(archive), None, str(made["embedded"]), BuildOptions(format="squashfs"))
    return made


def _unsquashed(image: Path, dest: Path) -> Path:
    """``unsquashfs -d``, after ``-s`` and ``-lls``: none may say anything is wrong. An
    image of the generated shapes has its big folder's listing past 64 KiB, as meant."""
    for args in (["-s"], ["-lls"], ["-d", str(dest)]):
        done = subprocess.run(
            ["unsquashfs", *args, str(image)], capture_output=True, errors="replace", text=True
        )
        said = (done.stdout + done.stderr).lower()
        assert done.returncode == 0 and "error" not in said and "fatal" not in said, said
        for line in done.stdout.splitlines() if args == ["-lls"] else ():
            if line.endswith(f"/n{BIG}"):  # mode, owner, size, date, time, path
                assert int(line.split()[2]) > 0xFFFF, line
    return dest


def _modes_are_the_images(root: Path) -> None:
    for dirpath, _dirnames, filenames in os.walk(root):
        assert stat.S_IMODE(os.stat(dirpath).st_mode) == 0o555, dirpath
        for name in filenames:
            st = os.lstat(os.path.join(dirpath, name))
            if stat.S_ISREG(st.st_mode):
                assert stat.S_IMODE(st.st_mode) == 0o444, name


def _fixed_folder_times(found: dict, expected: dict, started: int) -> dict:
    """GNU tar sets a folder's time when it leaves it; members appended to it later
    (tar -u/-r) leave the time of extraction there, not the archive's."""
    for rel, entry in expected.items():
        if entry[0] == "dir" and entry[1] >= started and found.get(rel, ("dir",))[0] == "dir":
            found[rel] = entry
    return found


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_corpus_unsquashes_as_gnu_tar_extracts_it(name: str, tmp_path: Path) -> None:
    case, archives = built_alone(name, tmp_path / "work")
    reference = tmp_path / "reference"
    started = int(time.time())
    failed = tar_corpus.reference_extract(case, archives, reference)
    if case.refusal is not None:
        assert failed is not None
        with pytest.raises(
            (UnsafeArchiveMember, UnknownFormat, CorruptArchive), match=case.refusal
        ):
            build_image(str(archives[0]), str(tmp_path / "x.sqfs"), BuildOptions(format="squashfs"))
        assert not list(tmp_path.glob("x.sqfs*")), "a refused build leaves nothing"
        return
    assert failed is None, failed
    expected = tar_corpus.snapshot(reference)
    for way, image in _images(archives[0], tmp_path).items():
        out = _unsquashed(image, tmp_path / f"out-{way}")
        _modes_are_the_images(out)
        assert _fixed_folder_times(tar_corpus.snapshot(out), expected, started) == expected, way


# The big folder's entries: its listing (~26 bytes an entry, a header every few)
# passes one metadata block (an index) and 64 KiB (the size only an extended folder
# inode holds), which _unsquashed checks. Each entry costs a file made, tarred,
# extracted, unsquashed and read through FUSE, in both runs of make test (10,050
# took the module ~2.5x as long, and reached no branch more).
BIG = 3_000


def _shapes(root: Path) -> Path:
    """What a squashfs writer can get wrong: folder sizes around a directory header's
    256 entries and past one metadata block (an index) and 64 KiB, names of 255 bytes
    and UTF-8, files around the 128 KiB block, empty ones, symlinks, hard links across
    folders, a sparse file, a deep path."""
    write = tar_corpus._write  # noqa: SLF001 - the corpus's own writer
    for count in (0, 1, 255, 256, 257, BIG):
        folder = root / f"n{count}"
        folder.mkdir(parents=True)
        for index in range(count):
            (folder / f"f{index:05d}").write_bytes(b"%d" % index)
    write(root / "names" / ("x" * 255), b"255")
    write(root / "names" / ("é" * 127), b"254 bytes of UTF-8")
    write(root / "names" / "日本語 ファイル", b"utf-8")
    block = squashfs.BLOCK
    for label, size in (("one", block), ("one-plus", block + 1), ("many", 9 * block + 5)):
        write(root / "sizes" / label, os.urandom(size))
    write(root / "sizes" / "empty", b"")
    os.symlink("../sizes/one", root / "names" / "to-one")
    os.symlink("nowhere", root / "names" / "dangling")
    os.link(root / "sizes" / "one-plus", root / "n1" / "hard-elsewhere")
    os.link(root / "sizes" / "one-plus", root / "names" / "hard-again")
    with open(root / "sizes" / "sparse", "wb") as sparse:
        sparse.write(b"head")
        sparse.seek(5 * block)
        sparse.write(b"tail")
    deep = root.joinpath(*["deep"] * 80)
    write(deep / "bottom", b"deep")
    tar_corpus._settle_dirs(root)  # noqa: SLF001
    return root


@pytest.fixture(scope="module")
def shapes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _shapes(tmp_path_factory.mktemp("shapes") / "tree")


def _as_user_snapshot(user: User, python: str, root: Path) -> dict:
    """tar_corpus.snapshot of ``root``, taken as ``user`` (a FUSE mount is its user's
    alone), through JSON."""
    code = "import json, sys; from tests import tar_corpus; "
    code += "print(json.dumps(tar_corpus.snapshot(sys.argv[1])))"
    done = user.run([python, "-c", code, str(root)], cwd=os.getcwd(), timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@dataclass
class Built:
    """The shapes as a tar of one format, what ``tar -xf`` makes of it, and its images."""

    archive: Path
    expected: dict
    images: dict[str, Path]


@pytest.fixture(scope="module", params=["gnu", "posix"])
def built(request: pytest.FixtureRequest, shapes: Path) -> Iterator[Built]:
    """Made once per format for both tests below, in a folder every user can reach (the
    FUSE test mounts the images as a user)."""
    fmt = request.param
    folder = Path(tempfile.mkdtemp(prefix=f"stager-shapes-{fmt}-", dir="/tmp"))
    folder.chmod(0o755)
    try:
        archive = folder / "shapes.tar"
        tar_corpus.gnu_tar("-cf", archive, f"--format={fmt}", "--sparse", "-C", shapes, ".")
        reference = folder / "reference"
        reference.mkdir()
        tar_corpus.gnu_tar("--no-same-owner", "-xf", archive, "-C", reference)
        expected = tar_corpus.snapshot(reference)
        assert len(expected) > BIG
        images = _images(archive, folder)
        for image in images.values():
            image.chmod(0o644)
        yield Built(archive, expected, images)
    finally:
        subprocess.run(["rm", "-rf", "--one-file-system", "--", str(folder)], check=False)


def test_generated_shapes_read_back_through_unsquashfs(built: Built, tmp_path: Path) -> None:
    for way, image in built.images.items():
        out = _unsquashed(image, tmp_path / f"out-{way}")
        _modes_are_the_images(out)
        assert tar_corpus.snapshot(out) == built.expected, way
    # The sparse file's hole is stored as sparse blocks: the image is not 5 blocks larger.
    assert image.stat().st_size < built.archive.stat().st_size + (4 << 20)


def test_generated_shapes_read_back_through_squashfuse_as_a_user(
    built: Built,
    shared_tmp: Path,
    users: tuple[User, User],
    interpreter_for_users: str,
    fuse_for_users: None,
) -> None:
    if shutil.which("squashfuse_ll") is None:
        pytest.skip("needs squashfuse_ll (Debian: squashfuse)")
    alice, _ = users
    for way, image in built.images.items():
        target = shared_tmp / f"mnt-{way}"
        target.mkdir()
        os.chown(target, alice.uid, alice.gid)
        mounted = alice.run(["squashfuse_ll", "-o", "ro", str(image), str(target)])
        assert mounted.returncode == 0, mounted.stderr
        try:
            found = _as_user_snapshot(alice, interpreter_for_users, target)
        finally:
            done = alice.run(["fusermount3", "-u", str(target)])
            assert done.returncode == 0, done.stderr
        assert found == json.loads(json.dumps(built.expected)), way


def test_a_tree_and_a_compressed_tar_make_the_same_image_contents(
    shapes: Path, tmp_path: Path
) -> None:
    """The walk of a folder and a .tar.gz's stream go through the writer's other doors
    (file_range from a file, file_stream): the same tree comes out."""
    archive = tmp_path / "shapes.tar.gz"
    tar_corpus.gnu_tar("-czf", archive, "-C", shapes, ".")
    for source in (shapes, archive):
        image = tmp_path / f"{source.name}.sqfs"
        build_image(str(source), str(image), BuildOptions(format="squashfs"))
        out = _unsquashed(image, tmp_path / f"out-{source.name}")
        assert tar_corpus.snapshot(out) == tar_corpus.snapshot(shapes), source.name
