"""An image's symlinks judged as the kernel resolves them in the mounted image, and its
names held to the kernel's limits.

The builder's verdict on generated archives of folders and symlinks (names from a
few letters, targets made of those, ``.`` and ``..``) is checked against the kernel
itself: the same archive built with the final judge turned off is mounted, and every
name in it is resolved by the kernel (``realpath`` through the mount). The builder
must refuse exactly the archives in which some name leads outside the mount.
"""

from __future__ import annotations

import io
import itertools
import os
import random
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

from stager.core.errors import UnsafeArchiveMember
from stager.image import mount as image_mount
from stager.image import names
from stager.image.build import BuildOptions, Names, TreeInput, build_from, build_image

Mount = Callable[..., Path]
LETTERS = ["a", "b"]
LINKS = ["1", "2", "3", "4"]


def _tar(path: Path, members: list[tuple[str, str | None]]) -> Path:
    """A tar of folders (target None) and symlinks, in that order (Python's tarfile: a
    name given twice is kept twice, the later one wins when extracted)."""
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, target in members:
            info = tarfile.TarInfo(name)
            info.mtime = 1_700_000_000
            if target is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
            else:
                info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
    return path


def _file_tar(path: Path, name: str) -> Path:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo(name)
        info.size = 5
        tar.addfile(info, io.BytesIO(b"hello"))
    return path


def _refusal(archive: Path, image: Path) -> str | None:
    try:
        build_image(str(archive), str(image))
    except UnsafeArchiveMember as exc:
        return exc.message
    return None


@pytest.mark.parametrize(
    "members",
    [
        # The helper's first case: "a" is the top, so a/a/.. climbs one level per "..".
        [("a", "."), ("pw", "a/a/a/a/../../../../etc/passwd")],
        # Placed through "a" at the top, judged where it lands: one ".." is one too many.
        [("a", "."), ("a/a/a/pw", "../etc/passwd")],
        # Judged inside while "d" was a folder; "d" is a link to the top at the end.
        [("d", None), ("pw", "d/../etc/passwd"), ("d", ".")],
        # Through a chain of links, the last one climbing.
        [("x", "y"), ("y", "z/.."), ("z", None), ("z/w", ".."), ("pw", "x/../etc")],
    ],
    ids=["dot-link", "placed-through-a-link", "folder-replaced-by-a-link", "chain"],
)
def test_a_link_that_climbs_out_through_the_images_own_links_is_refused(
    members: list[tuple[str, str | None]], tmp_path: Path
) -> None:
    archive = _tar(tmp_path / "links.tar", members)
    image = tmp_path / "out.erofs"
    refusal = _refusal(archive, image)
    assert refusal is not None and "leads outside the dataset" in refusal, refusal
    assert not image.exists() and not Path(f"{image}.partial").exists()


def test_a_tree_whose_rename_puts_a_link_through_another_link_is_refused(tmp_path: Path) -> None:
    """A folder packed from a walk, renamed as a recipe would: the link is judged where
    it lands in the image, not through the source's own symlink of the new name (the
    walk judged ``b/pw`` through the source's link ``b``, three folders down)."""
    source = tmp_path / "src"
    deep = source / "d1" / "d2" / "d3"
    deep.mkdir(parents=True)
    (deep / "pw").symlink_to("../../../etc/passwd")  # the top's own etc/passwd, there
    (source / "b").symlink_to("d1/d2/d3")
    image = tmp_path / "out.erofs"
    renames = (("d1/d2/d3", "b"),)  # now b/pw in the image: "../../../" climbs out
    with pytest.raises(UnsafeArchiveMember, match="leads outside the dataset"):
        build_from([TreeInput(str(source), Names(renames=renames))], str(image))
    assert not image.exists()


def test_a_link_refused_in_a_walk_is_said_as_an_unsafe_member(tmp_path: Path) -> None:
    """Refused by its words during the walk: a sentence naming it, not an internal error."""
    source = tmp_path / "src"
    (source / "d").mkdir(parents=True)
    (source / "d" / "pw").symlink_to("../../etc/passwd")
    with pytest.raises(UnsafeArchiveMember, match="'d/pw'.*outside"):
        build_from([TreeInput(str(source))], str(tmp_path / "out.erofs"))


def test_a_link_inside_the_image_through_its_own_links_is_kept(
    tmp_path: Path, kernel_mount: Mount
) -> None:
    members = [("a", "."), ("d", None), ("d/e", None), ("up", "d/e/../.."), ("in", "a/a/d/e/..")]
    image = tmp_path / "ok.erofs"
    build_image(str(_tar(tmp_path / "ok.tar", members)), str(image))
    top = kernel_mount(image, backing="file")
    assert os.path.realpath(top / "up") == str(top)
    assert os.path.realpath(top / "in") == str(top / "d")


def test_a_link_longer_than_the_kernel_reads_is_refused(tmp_path: Path) -> None:
    # Cut at 4095 bytes, these words would end in "..": other words than those judged.
    target = "x/" * 2047 + ".."
    archive = _tar(tmp_path / "long.tar", [("x", None), ("up", target)])
    with pytest.raises(UnsafeArchiveMember, match="4095"):
        build_image(str(archive), str(tmp_path / "out.erofs"))


@pytest.mark.parametrize("fmt", ["erofs", "squashfs"])  # squashfs: a plain tar's files_range
@pytest.mark.parametrize("length", [256, 300, 4000])  # past 4095: the path is refused
def test_a_name_longer_than_a_file_system_allows_is_refused(
    length: int, fmt: str, tmp_path: Path
) -> None:
    for kind, archive in [
        ("file", _file_tar(tmp_path / f"f{length}.tar", "d/" + "A" * length)),
        ("folder", _tar(tmp_path / f"d{length}.tar", [("d/" + "B" * length + "/e", None)])),
        ("link", _tar(tmp_path / f"l{length}.tar", [("C" * length, ".")])),
    ]:
        image = tmp_path / f"{kind}.img"
        with pytest.raises(UnsafeArchiveMember, match=f"name of {length} bytes"):
            build_image(str(archive), str(image), BuildOptions(format=fmt))
        assert not image.exists(), kind


def test_a_name_of_255_bytes_reads_back_through_the_kernel(
    tmp_path: Path, kernel_mount: Mount
) -> None:
    name = "é" * 127 + "z"  # 255 bytes in UTF-8
    image = tmp_path / "ok.erofs"
    build_image(str(_file_tar(tmp_path / "ok.tar", f"d/{name}")), str(image))
    top = kernel_mount(image, backing="file")
    assert os.listdir(top / "d") == [name]
    assert (top / "d" / name).read_bytes() == b"hello"


def _random_archive(rng: random.Random) -> list[tuple[str, str | None]]:
    """Folders named from letters, then symlinks named from digits (at the top or in a
    folder) whose targets walk through the names beside them: links to "." or "..", and
    names then as many ".." as the words allow (inside by their words), are what can
    climb out once the names on the way are links themselves."""
    folders = sorted({"/".join(rng.choice(LETTERS) for _ in range(rng.randint(1, 2)))
                      for _ in range(rng.randint(1, 3))})  # fmt: skip
    members: list[tuple[str, str | None]] = [(folder, None) for folder in folders]
    links = [f"{rng.choice(['', *folders])}/{n}".lstrip("/") for n in LINKS[: rng.randint(2, 4)]]
    for name in links:
        folder = name.rpartition("/")[0]
        beside = [n.rpartition("/")[2] for n in folders + links if n.rpartition("/")[0] == folder]
        if rng.random() < 0.3:
            members.append((name, rng.choice([".", "..", "./.", f"{rng.choice(beside)}/.."])))
            continue
        names = [rng.choice(beside) for _ in range(rng.randint(1, 3))]
        depth = folder.count("/") + 1 if folder else 0
        ups = [".."] * rng.randint(0, len(names) + depth)
        tail = [rng.choice(LETTERS)] if rng.random() < 0.3 else []
        members.append((name, "/".join(names + ups + tail)))
    return members


def _outside(base: Path) -> Path:
    """Where the generated images are mounted: five folders down, each folder on the way
    holding every name a walk out can take (trees of the letters, four deep), so that
    the kernel resolves any walk that leaves a mount to something outside it."""
    here = base
    here.mkdir()
    for level in range(6):
        for depth in range(1, 4):
            for path in itertools.product(LETTERS + LINKS, repeat=depth):
                (here.joinpath(*path)).mkdir(exist_ok=True)
        if level < 5:
            here = here / f"x{level}"
            here.mkdir()
    return here


def _escapes(top: Path) -> list[str]:
    """Every name under the mount that the kernel resolves to outside it (read back from
    the descriptor it opened; a name it cannot resolve, ENOENT or ELOOP, leads nowhere)."""
    found = []
    for folder, dirs, files in os.walk(top):
        for name in dirs + files:
            path = os.path.join(folder, name)
            try:
                fd = os.open(path, os.O_PATH)
            except OSError:
                continue
            try:
                real = os.readlink(f"/proc/self/fd/{fd}")
            finally:
                os.close(fd)
            if real != str(top) and not real.startswith(f"{top}/"):
                found.append(f"{os.path.relpath(path, top)} -> {real}")
    return found


def test_the_builders_verdict_on_generated_links_is_the_kernels(
    tmp_path: Path, kernel_mount: Mount, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refused exactly when the kernel, reading the same image built without the final
    judge, resolves some name of it outside the mount (mount points are named mntN,
    which no walk out can come back in through)."""
    outside = _outside(tmp_path / "o")
    rng = random.Random(31)
    early = refused = kept = 0
    for case in range(300):
        members = _random_archive(rng)
        archive = _tar(tmp_path / f"c{case}.tar", members)
        verdict = _refusal(archive, tmp_path / f"c{case}.erofs")
        unjudged = tmp_path / f"c{case}.unjudged.erofs"
        with monkeypatch.context() as patch:
            patch.setattr(names._LinkJudge, "judge_all", lambda self: None)
            if _refusal(archive, unjudged) is not None:  # by its words, or a conflict
                assert verdict is not None, members
                early += 1
                continue
        top = outside / f"mnt{case}"
        top.mkdir()
        image_mount.mount_kernel(str(unjudged), str(top), "file")
        try:
            escapes = _escapes(top)
        finally:
            image_mount.unmount(str(top))
        assert (verdict is not None) == bool(escapes), (members, verdict, escapes)
        assert verdict is None or "leads outside the dataset" in verdict, verdict
        refused += verdict is not None
        kept += verdict is None
    assert refused >= 10 and kept >= 10, (early, refused, kept)  # both verdicts reached


def test_a_chain_of_links_longer_than_the_kernel_follows_is_kept(tmp_path: Path) -> None:
    """2,000 links, each to the one before: past 40 hops the kernel stops (ELOOP), and
    so does the judge of each link, which ends and keeps them (nothing leads out)."""
    members: list[tuple[str, str | None]] = [("l0", ".")]
    members += [(f"l{i}", f"l{i - 1}") for i in range(1, 2000)]
    image = tmp_path / "chain.erofs"
    built = build_image(str(_tar(tmp_path / "chain.tar", members)), str(image), BuildOptions())
    assert built.files == 2000
