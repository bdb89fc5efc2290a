"""Mounts of real images: read-only, nosuid, nodev, taken down again; FUSE for squashfs
(squashfuse) as a real second user; a missing tool named by its Debian package."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from stager.image import mount as image_mount
from stager.image.build import build_image
from tests import tar_corpus


@pytest.fixture
def image(tmp_path: Path) -> Path:
    tree = tar_corpus.basic_tree(tmp_path / "src")
    built = tmp_path / "basic.erofs"
    build_image(str(tree), str(built))
    return built


def _loops_of(image: Path) -> list[str]:
    listed = subprocess.run(["losetup", "-j", str(image)], capture_output=True, text=True)
    return listed.stdout.split()


@pytest.mark.parametrize("backing", ["loop", "file"])
def test_a_kernel_mount_is_read_only_nosuid_nodev(image: Path, kernel_mount, backing: str) -> None:
    mounted = kernel_mount(image, backing=backing)
    found = image_mount.mounted_at(str(mounted))
    assert found is not None and found.fstype == "erofs"
    assert {"ro", "nosuid", "nodev"} <= set(found.options.split(","))
    if backing == "file":
        assert found.source == str(image)  # the file itself: no loop device
    else:
        assert found.source.startswith("/dev/loop") and _loops_of(image)
    assert (mounted / "a.txt").read_bytes() == b"alpha\n"
    with pytest.raises(OSError, match="Read-only"):
        os.chmod(mounted / "a.txt", 0o666)
    image_mount.unmount(str(mounted))
    assert not _loops_of(image), "the unmount frees the loop device"


def test_unmount_takes_it_down_and_refuses_while_in_use(image: Path, kernel_mount) -> None:
    mounted = kernel_mount(image)
    reader = subprocess.Popen(["sleep", "30"], cwd=mounted)
    try:
        with pytest.raises(image_mount.MountError, match="in use"):
            image_mount.unmount(str(mounted))
        assert image_mount.mounted_at(str(mounted)) is not None
    finally:
        reader.kill()
        reader.wait()
    image_mount.unmount(str(mounted))
    assert image_mount.mounted_at(str(mounted)) is None
    image_mount.unmount(str(mounted))  # nothing there: nothing to do
    os.unlink(image)  # eviction: one file


def test_not_an_image_is_named(tmp_path: Path) -> None:
    junk = tmp_path / "junk.img"
    junk.write_bytes(b"x" * 4096)
    with pytest.raises(image_mount.MountError, match="neither an EROFS nor a squashfs"):
        image_mount.mount_kernel(str(junk), str(tmp_path))


def test_a_missing_fuse_reader_names_its_debian_package(
    image: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))  # as on a node without it
    monkeypatch.setattr(shutil, "which", lambda name, path=None: None)
    with pytest.raises(image_mount.MountError, match="install the Debian package fuse3"):
        image_mount.mount_fuse(str(image), str(tmp_path))


def test_erofs_by_fuse_needs_erofsfuse(image: Path, tmp_path: Path) -> None:
    if shutil.which("erofsfuse"):
        pytest.skip("erofsfuse is installed here")
    if shutil.which("fusermount3") is None:
        pytest.skip("needs fuse3")
    target = tmp_path / "t"
    target.mkdir()
    with pytest.raises(image_mount.MountError, match="Debian package erofsfuse"):
        image_mount.mount_fuse(str(image), str(target))


def test_a_user_mounts_squashfs_with_fuse_and_reads_it(
    tmp_path: Path, users, interpreter_for_users: str
) -> None:
    """Per-user mode on Debian 12: squashfs (sqfstar from the tar) through squashfuse_ll,
    mounted, read and unmounted by a real unprivileged user."""
    for tool, package in (("sqfstar", "squashfs-tools"), ("squashfuse_ll", "squashfuse")):
        if shutil.which(tool) is None:
            pytest.skip(f"needs {package}")
    if shutil.which("fusermount3") is None or os.geteuid() != 0:
        pytest.skip("needs fuse3 and root (to become a second user)")
    user = users[0]
    reachable = Path(tempfile.mkdtemp(prefix="stager-image-fuse-"))  # pytest's is root's 0700
    # Debian's udev makes /dev/fuse 0666; a container may leave it 0600: as Debian has it,
    # for this test only.
    fuse_mode = stat.S_IMODE(os.stat("/dev/fuse").st_mode)
    os.chmod("/dev/fuse", fuse_mode | 0o666)
    try:
        _mount_as(user, interpreter_for_users, tmp_path, reachable)
    finally:
        os.chmod("/dev/fuse", fuse_mode)
        shutil.rmtree(reachable)


def _mount_as(user, interpreter: str, tmp_path: Path, reachable: Path) -> None:
    tree = tar_corpus.basic_tree(tmp_path / "src")
    archive = tmp_path / "a.tar"
    tar_corpus.gnu_tar("-cf", archive, "-C", tree, ".")
    image = reachable / "a.sqfs"
    with open(archive, "rb") as stream:
        subprocess.run(
            ["sqfstar", "-quiet", "-no-progress", "-no-duplicates", str(image)],
            stdin=stream,
            check=True,
        )
    target = reachable / "mnt"
    target.mkdir()
    os.chmod(reachable, 0o755)
    for path in (target, image):
        os.chown(path, user.uid, user.gid)
    script = (
        "import sys; from stager.image import mount as m; "
        "m.mount_fuse(sys.argv[1], sys.argv[2]); "
        "print(open(sys.argv[2] + '/a.txt').read(), end=''); "
        "m.unmount(sys.argv[2])"
    )
    done = user.run([interpreter, "-c", script, str(image), str(target)])
    try:
        assert done.returncode == 0, done.stderr
        assert done.stdout == "alpha\n"
        assert image_mount.mounted_at(str(target)) is None
    finally:
        if image_mount.mounted_at(str(target)) is not None:
            image_mount.unmount(str(target))
