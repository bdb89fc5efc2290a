"""The node service against a user who looks for another's private data outside the
API: in the kernel's mount table, in ``/sys/block``, by ``stat``, ``statfs`` or
``ls`` of any path under the cache, or by guessing where a key would be. Real users
(tests/users.py): bob is the attacker, alice holds a private tree and a private image.

Each test failed on the release before stager.state.layout (main 7101f21), where a private
copy lived at ``data/<key>``: its key is a hash of facts bob may know (the request, the
sources' sizes and times, alice's uid), its mount point was in ``/proc/mounts``, and
``stat``/``statfs`` of it told whose it was, its entry count and its size.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stager.image import mount as image_mount
from stager.image.published import key_of
from tests.daemon import Daemon, node_service, unmount_under
from tests.trees import make_tar, write_tree
from tests.users import User


def stage_ready(user: User, service: Daemon, body: dict) -> dict:
    code, answer = user.curl(service.socket, "POST", "/v1/datasets", body)
    assert code in (200, 202), answer
    code, answer = user.curl(service.socket, "GET", f"/v1/datasets/{body['name']}/wait?timeout=60")
    assert code == 200 and answer["state"] == "ready", answer
    return answer


def own(path: Path, user: User, mode: int) -> None:
    for found in [path, *path.rglob("*")]:
        os.chown(found, user.uid, user.gid, follow_symlinks=False)
        os.chmod(found, mode | (0o111 if found.is_dir() else 0))


def private_sources(alice: User, home: Path) -> tuple[Path, Path]:
    """A folder and a tar only alice may read: her copies of them are private."""
    tree = write_tree(home / "mine", n_files=5, seed=4)
    archive = make_tar(tree, home / "mine.tar")
    own(tree, alice, 0o600)
    own(archive, alice, 0o600)
    return tree, archive


@pytest.fixture
def cache(shared_tmp: Path) -> Iterator[Path]:
    folder = shared_tmp / "cache"
    try:
        yield folder
    finally:
        unmount_under(folder)  # what a test mounted by hand, should it fail before a stop


def test_another_users_private_data_leaves_no_trace_outside_the_api(
    users: tuple[User, User], shared_tmp: Path, alice_home: Path, cache: Path
) -> None:
    """alice stages a private tree and a private image. bob reads the mount table and
    ``/sys/block``, and tries every path under the cache he can name (those the mount
    table shows, and ``data/<key>`` for alice's keys, as if he had worked them out):
    nothing names alice's uid or a key of hers, and every look at her data is refused
    or finds nothing, alike whether she holds anything or not. alice reads both through
    the paths the API gave her; a shared copy is read by both. (What the mount table
    still shows, that an image is mounted and, by its gate's ACL, whose, is the
    kernel's to show: docs/multiuser.md.)"""
    alice, bob = users
    tree, archive = private_sources(alice, alice_home)
    public = write_tree(shared_tmp / "public", n_files=3, seed=5)
    own(public, alice, 0o644)
    with node_service(cache) as service:
        mine = stage_ready(
            alice, service, {"name": "t", "steps": [{"op": "copy", "src": str(tree)}]}
        )
        image = stage_ready(
            alice,
            service,
            {"name": "i", "steps": [{"op": "extract", "src": str(archive)}], "image": True},
        )
        shared = stage_ready(
            bob, service, {"name": "s", "steps": [{"op": "copy", "src": str(public)}]}
        )
        keys = [mine["key"], image["key"]]
        paths = [Path(mine["path"]), Path(image["path"]), Path(image["image"]["file"])]

        # alice reads her own, through the paths she was given; both read the shared one.
        first = next(p for p in sorted(tree.rglob("*")) if p.is_file())
        for top, inside in ((paths[0], first.relative_to(tree)), (paths[1], Path("mine"))):
            assert alice.run(["ls", "-R", str(top / inside)]).returncode == 0, top
        for user in (alice, bob):
            assert user.run(["ls", "-R", shared["path"]]).returncode == 0

        # The mount table and the loop devices, as bob reads them.
        table = bob.run(["cat", "/proc/self/mountinfo", "/proc/mounts"]).stdout
        assert image["path"] in table  # every mount is listed: its name must say nothing
        for word in [*keys, alice.name, str(alice.uid)]:
            named = [line for line in table.splitlines() if str(cache) in line and word in line]
            assert not named, (word, named)
        loops = bob.run(["sh", "-c", "cat /sys/block/loop*/loop/backing_file 2>/dev/null"])
        assert str(cache) not in loops.stdout, loops.stdout  # no loop device: no size in sysfs

        # Every path bob can name, from the table or from alice's keys: stat, statfs and
        # ls refused, or nothing there (as for a key nobody holds).
        targets = [Path(m.target) for m in image_mount.mounts_under(str(cache))]
        sources = [Path(m.source) for m in image_mount.mounts_under(str(cache))]
        named = {*paths, *targets, *(s for s in sources if s.is_absolute())}
        guessed = [cache / "data" / f"{k}{suffix}" for k in keys for suffix in ("", ".erofs")]
        nobody = cache / "data" / secrets.token_hex(12)
        for path in sorted(named | set(guessed)):
            if path == Path(shared["path"]):
                continue
            for argv in (["stat", str(path)], ["stat", "-f", str(path)], ["ls", str(path)]):
                looked = bob.run(argv)
                assert looked.returncode != 0, (argv, looked.stdout)
                said = looked.stderr.replace(str(path), "PATH")
                if path in guessed:  # refused as a path nobody holds is
                    alike = bob.run([argv[0], *argv[1:-1], str(nobody)]).stderr
                    assert said == alike.replace(str(nobody), "PATH"), (argv, said)
                else:
                    assert "Permission denied" in said, (argv, said)
        # Nor can bob list what lies around them.
        for folder in (cache / "data", cache / "data" / "u"):
            assert bob.run(["ls", str(folder)]).returncode != 0, folder
        assert not any(k in bob.run(["find", str(cache)]).stdout for k in keys)

        # alice herself only passes her gates: she lists and changes nothing there.
        for gate in (paths[0].parent, paths[1].parent):
            assert alice.run(["ls", str(gate)]).returncode != 0
            assert alice.run(["touch", str(gate / "x")]).returncode != 0
            assert alice.run(["mv", str(gate / "dataset"), str(gate / "y")]).returncode != 0
        # Her copies deleted, their gates go with them.
        for name in ("t", "i"):
            code, answer = alice.curl(service.socket, "DELETE", f"/v1/datasets/{name}")
            assert code == 200, answer
        users_dir = cache / "data" / "u"
        deadline = time.monotonic() + 15
        while any(users_dir.iterdir()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(users_dir.iterdir()), list(users_dir.iterdir())


def test_private_copies_an_earlier_release_left_at_data_key_are_moved_and_still_served(
    users: tuple[User, User], alice_home: Path, cache: Path
) -> None:
    """A cache as the release before left it: alice's private tree at ``data/<key>``
    and her image at ``data/<key>.erofs``, mounted at ``data/<key>``. The next start
    moves both to their place (the tree in one rename, the image mounted there and its
    old mount taken down), points her link at the new place, and serves both as hits;
    nothing stays at ``data/<key>``."""
    alice, bob = users
    tree, archive = private_sources(alice, alice_home)
    link = alice_home / "link"
    tree_body = {"name": "t", "steps": [{"op": "copy", "src": str(tree)}], "link": str(link)}
    image_body = {"name": "i", "steps": [{"op": "extract", "src": str(archive)}], "image": True}
    with node_service(cache) as service:
        mine, image = (
            stage_ready(alice, service, tree_body),
            stage_ready(alice, service, image_body),
        )
    data = cache / "data"
    # What the earlier release made: the same keys, at data/<key>.
    new_tree, new_top, new_file = (
        Path(mine["path"]),
        Path(image["path"]),
        Path(image["image"]["file"]),
    )
    old_tree, old_top = data / mine["key"], data / image["key"]
    old_file = data / f"{image['key']}.erofs"
    os.rmdir(new_top)  # unmounted as the service stopped (tests.daemon)
    os.rename(new_tree, old_tree)
    os.rename(new_file, old_file)
    os.mkdir(old_top, 0o555)
    image_mount.mount_kernel(str(old_file), str(old_top))
    link.unlink()
    os.symlink(old_tree, link)
    assert bob.run(["stat", str(old_tree)]).returncode == 0  # the old leak, as it was

    with node_service(cache) as service:
        assert not os.path.lexists(old_tree) and not os.path.lexists(old_file)
        assert image_mount.mounted_at(str(old_top)) is None
        assert not os.path.lexists(old_top)
        assert os.readlink(link) == str(new_tree)  # pointed there at the start
        for body, was in ((tree_body, mine), (image_body, image)):
            again = stage_ready(alice, service, body)
            assert again["origin"]["hit"] is True and again["key"] == was["key"], again
            assert again["path"] == was["path"]
        first = next(p.relative_to(tree) for p in sorted(tree.rglob("*")) if p.is_file())
        assert alice.run(["sha256sum", str(link / first)]).returncode == 0
        assert alice.run(["ls", str(new_top / "mine")]).returncode == 0
        assert image_mount.mounted_at(str(new_top)) is not None
        left = {key_of(p.name) for p in data.iterdir()}
        assert not left & {mine["key"], image["key"]}, left

    # The next start finds them in their place (the node's secret kept): hits again.
    with node_service(cache) as service:
        for body, was in ((tree_body, mine), (image_body, image)):
            again = stage_ready(alice, service, body)
            assert again["origin"]["hit"] is True and again["path"] == was["path"], again
