"""Image datasets in the node service, with real users (tests/users.py): a private
image only its user may enter, a shared one every user reads from one copy, and no
image file of a user's making ever mounted by the kernel."""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from stager.image import mount as image_mount
from stager.image.build import build_image
from tests.daemon import Daemon, node_service
from tests.trees import make_tar, write_tree
from tests.users import User


@pytest.fixture
def trusted(shared_tmp: Path) -> Path:
    """The admin's folder of prebuilt images: root's, 0755."""
    folder = shared_tmp / "trusted"
    folder.mkdir(mode=0o755)
    return folder


@pytest.fixture
def service(users: tuple[User, User], shared_tmp: Path, trusted: Path) -> Iterator[Daemon]:
    with node_service(shared_tmp / "cache", STAGER_TRUSTED_IMAGE_DIRS=str(trusted)) as daemon:
        yield daemon


def own(path: Path, user: User, mode: int) -> None:
    for found in [path, *path.rglob("*")]:
        os.chown(found, user.uid, user.gid, follow_symlinks=False)
        os.chmod(found, mode | (0o111 if found.is_dir() else 0))


def stage(user: User, service: Daemon, body: dict) -> tuple[int, dict]:
    code, answer = user.curl(service.socket, "POST", "/v1/datasets", body)
    assert code in (200, 202), answer
    return user.curl(service.socket, "GET", f"/v1/datasets/{body['name']}/wait?timeout=60")


def image_request(archive: Path, name: str = "imgs") -> dict:
    return {"name": name, "steps": [{"op": "extract", "src": str(archive)}], "image": True}


def test_a_private_image_is_entered_by_its_user_alone(
    users: tuple[User, User], service: Daemon, alice_home: Path
) -> None:
    alice, bob = users
    tree = write_tree(alice_home / "mine", n_files=6, seed=1)
    archive = make_tar(tree, alice_home / "mine.tar")
    own(tree, alice, 0o600)
    own(archive, alice, 0o600)  # only alice may read it: her copy is private
    code, status = stage(alice, service, image_request(archive))
    assert code == 200 and status["state"] == "ready", status
    top = Path(status["path"])
    st = top.stat()  # the image's own top folder, over the mount point
    assert (st.st_uid, st.st_mode & 0o777) == (alice.uid, 0o500)
    assert image_mount.mounted_at(str(top)) is not None
    file = Path(status["image"]["file"])
    assert (file.stat().st_uid, file.stat().st_mode & 0o777) == (0, 0o400)
    first = top / "mine" / "class_0" / "img_0000.jpg"
    read = alice.run(["sha256sum", str(first)])
    assert read.returncode == 0, read.stderr
    original = tree / first.relative_to(top / "mine")
    assert read.stdout.split()[0] == hashlib.sha256(original.read_bytes()).hexdigest()
    # alice cannot change it; bob can neither enter the mount nor read the image file.
    assert alice.run(["touch", str(top / "mine" / "new")]).returncode != 0
    assert alice.run(["chmod", "0777", str(top)]).returncode != 0
    for argv in (["ls", str(top)], ["cat", str(first)], ["cat", str(file)]):
        denied = bob.run(argv)
        assert denied.returncode != 0 and "Permission denied" in denied.stderr, argv
    assert alice.run(["cat", str(file)]).returncode != 0  # through the mount only


def test_a_shared_image_is_one_copy_every_user_reads(
    users: tuple[User, User], service: Daemon, alice_home: Path
) -> None:
    alice, bob = users
    tree = write_tree(alice_home / "public", n_files=6, seed=2)
    archive = make_tar(tree, alice_home / "public.tar")
    own(tree, alice, 0o644)
    own(archive, alice, 0o644)
    code, mine = stage(alice, service, image_request(archive))
    assert code == 200 and mine["state"] == "ready", mine
    code, theirs = stage(bob, service, image_request(archive, "bobs"))
    assert theirs["state"] == "ready" and theirs["key"] == mine["key"]
    assert theirs["origin"]["hit"] is True
    top = Path(theirs["path"])
    assert (top.stat().st_uid, top.stat().st_mode & 0o777) == (0, 0o555)
    assert bob.run(["sha256sum", str(top / "public" / "class_1" / "img_0001.jpg")]).returncode == 0
    mounts = [m for m in image_mount.mounts() if m.target == str(top)]
    assert len(mounts) == 1


def test_a_users_own_image_file_is_never_mounted_in_the_kernel(
    users: tuple[User, User], service: Daemon, alice_home: Path, trusted: Path
) -> None:
    alice, bob = users
    tree = write_tree(alice_home / "src", n_files=4, seed=3)
    own(tree, alice, 0o644)
    image = alice_home / "mine.erofs"
    build_image(str(tree), str(image))
    os.chown(image, alice.uid, alice.gid)
    sha = hashlib.sha256(image.read_bytes()).hexdigest()
    step = {"op": "image", "src": str(image), "sha256": sha}
    code, answer = alice.curl(
        service.socket, "POST", "/v1/datasets", {"name": "p", "steps": [step]}
    )
    assert code == 403 and answer["error"]["type"] == "untrusted_image", answer
    # Under a trusted folder, but in a sub-folder alice may write: not mounted either.
    planted = trusted / "alices"
    planted.mkdir(mode=0o755)
    os.chown(planted, alice.uid, alice.gid)
    shutil.copy(image, planted / "mine.erofs")
    step = {"op": "image", "src": str(planted / "mine.erofs"), "sha256": sha}
    code, status = stage(alice, service, {"name": "q", "steps": [step]})
    assert status["state"] == "failed", status
    assert "may be written by others than root" in status["error"]["message"]
    assert not image_mount.mounts_under(str(service.cache_dir))
    # The admin's image, pinned: mounted, and shared with everyone (bob reads it).
    admins = trusted / "dataset.erofs"
    shutil.copy(image, admins)
    os.chmod(admins, 0o444)
    no_pin = {"name": "r", "steps": [{"op": "image", "src": str(admins)}]}
    code, answer = alice.curl(service.socket, "POST", "/v1/datasets", no_pin)
    assert code == 403 and "sha256" in answer["error"]["message"]
    step = {"op": "image", "src": str(admins), "sha256": sha}
    code, status = stage(alice, service, {"name": "r", "steps": [step]})
    assert status["state"] == "ready", status
    code, status = stage(bob, service, {"name": "r", "steps": [step]})
    assert status["state"] == "ready" and status["origin"]["hit"] is True
    assert bob.run(["ls", str(Path(status["path"]) / "class_0")]).returncode == 0
