"""Image mode in a user's own daemon (no root): images are mounted with FUSE as the
user. On Debian 12 no FUSE reader of EROFS exists, so an image the daemon would build
is refused in one sentence, or staged as a tree where the request allows it; a
prebuilt squashfs is mounted with squashfuse_ll, read, and evicted by fusermount3."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from stager.image import mount as image_mount
from tests.daemon import Daemon
from tests.trees import digest, make_tar, write_tree
from tests.users import User


@pytest.fixture
def fuse_for_users() -> Iterator[None]:
    """/dev/fuse as Debian's udev leaves it (0666), for this test only (a container may
    leave it 0600)."""
    if not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None:
        pytest.skip("needs /dev/fuse and fuse3")
    mode = stat.S_IMODE(os.stat("/dev/fuse").st_mode)
    os.chmod("/dev/fuse", mode | 0o666)
    try:
        yield
    finally:
        os.chmod("/dev/fuse", mode)


@pytest.fixture
def alices_daemon(
    users: tuple[User, User], shared_tmp: Path, interpreter_for_users: str
) -> Iterator[Daemon]:
    alice, _ = users
    for path in [shared_tmp, *shared_tmp.rglob("*")]:
        os.chown(path, alice.uid, alice.gid)
    daemon = Daemon(cache_dir=shared_tmp / "cache", user=alice)
    daemon.start()
    try:
        yield daemon
    finally:
        daemon.stop()
        daemon.cleanup()


def owned(path: Path, user: User) -> Path:
    for found in [path, *path.rglob("*")]:
        os.chown(found, user.uid, user.gid)
    return path


def test_an_image_no_fuse_reader_can_mount_is_refused_or_staged_as_a_tree(
    users: tuple[User, User], alices_daemon: Daemon, shared_tmp: Path, fuse_for_users: None
) -> None:
    if shutil.which("erofsfuse"):
        pytest.skip("erofsfuse is installed here: the user's daemon can mount EROFS")
    alice, _ = users
    tree = owned(write_tree(shared_tmp / "t", n_files=5), alice)
    archive = owned(make_tar(tree, shared_tmp / "t.tar"), alice)
    body = {"name": "ds", "steps": [{"op": "extract", "src": str(archive)}], "image": True}
    with alices_daemon.client() as client:
        refused = client.post("/v1/datasets", json=body)
        assert refused.status_code == 422, refused.text
        error = refused.json()["error"]
        assert error["type"] == "image_unavailable"
        assert "erofsfuse" in error["message"] and "image_fallback" in error["message"]
        # The probe a fan-out plans by says the same: a tree (so its parts go early).
        probed = client.post("/v1/datasets/probe", json={**body, "image_fallback": True})
        assert probed.status_code == 200 and probed.json()["image"] is False, probed.text
        given = client.post("/v1/datasets", json={**body, "image_fallback": True})
        assert given.status_code in (200, 202), given.text
        assert "staged as a tree instead" in given.json()["notice"]
        status = client.get("/v1/datasets/ds/wait", params={"timeout": 60}).json()
        assert status["state"] == "ready" and status["image"] is None
        assert status["key"] == probed.json()["key"]
        assert digest(Path(status["path"]) / "t") == digest(tree)
        # The tree given is the tree's own entry: a plain request for it is a hit.
        del body["image"]
        plain = client.post("/v1/datasets", json={**body, "name": "plain"})
        assert plain.status_code == 200 and plain.json()["key"] == status["key"]


def test_a_prebuilt_squashfs_is_mounted_with_fuse_as_the_user(
    users: tuple[User, User], alices_daemon: Daemon, shared_tmp: Path, fuse_for_users: None
) -> None:
    for tool, package in (("sqfstar", "squashfs-tools"), ("squashfuse_ll", "squashfuse")):
        if shutil.which(tool) is None:
            pytest.skip(f"needs {package}")
    alice, _ = users
    tree = write_tree(shared_tmp / "t", n_files=5)
    archive = make_tar(tree, shared_tmp / "t.tar")
    image = shared_tmp / "t.sqfs"
    with open(archive, "rb") as stream:
        command = ["sqfstar", "-quiet", "-no-progress", "-no-duplicates", str(image)]
        subprocess.run(command, stdin=stream, check=True)
    owned(image, alice)
    body = {"name": "sq", "steps": [{"op": "image", "src": str(image)}]}
    with alices_daemon.client() as client:
        given = client.post("/v1/datasets", json=body)
        assert given.status_code in (200, 202), given.text
        status = client.get("/v1/datasets/sq/wait", params={"timeout": 60}).json()
        assert status["state"] == "ready", (status, alices_daemon.log())
        assert status["image"]["format"] == "squashfs" and status["image"]["mount"] == "fuse"
        found = image_mount.mounted_at(status["path"])
        assert found is not None and found.fstype.startswith("fuse")
        read = alice.run(
            ["sha256sum", str(Path(status["path"]) / "t" / "class_0" / "img_0000.jpg")]
        )
        assert read.returncode == 0, read.stderr
        assert client.delete("/v1/datasets/sq").status_code == 200
        assert image_mount.mounted_at(status["path"]) is None
        assert not Path(status["image"]["file"]).exists()
