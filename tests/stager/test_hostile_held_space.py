"""Space an eviction does not free, against a user who holds it on purpose (real users,
tests/users.py; image mounts by the node service as root).

alice keeps a process inside each of her image datasets (or a deleted tree's file
open) and deletes them one after another: each is unmounted lazily (or deleted), and
its blocks stay in use until her processes let go. That space stays on her books: her
quota refuses her next staging with a sentence that says so, bob's data is not evicted
for it and his staging goes on, and once her processes end the space is freed and
leaves her books within a sweep.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from subprocess import Popen

import pytest

from stager.engine.held_space import HeldSpace
from stager.image import mount as image_mount
from tests.daemon import Daemon, node_service
from tests.users import User

MIB = 1 << 20
QUOTA = 5 * MIB  # two 2 MiB datasets held, and a third refused
SWEEP_S = 0.3


def private_tar(user: User, folder: Path, name: str, nbytes: int, private: bool = True) -> Path:
    """A tar of ``nbytes`` of random bytes (no compression shrinks it), only ``user``
    may read: what they stage is their own copy, on their quota (or, not ``private``,
    every user may: shared, on nobody's quota)."""
    import tarfile

    data = folder / f"{name}-data"
    data.mkdir()
    (data / "blob.bin").write_bytes(os.urandom(nbytes))
    archive = folder / f"{name}.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(data, arcname=name)
    for path in (data, data / "blob.bin", archive):
        os.chown(path, user.uid, user.gid)
        path.chmod((0o700 if path.is_dir() else 0o600) | (0 if private else 0o055))
    return archive


def body(name: str, archive: Path, image: bool) -> dict:
    return {"name": name, "steps": [{"op": "extract", "src": str(archive)}], "image": image}


def staged(user: User, service: Daemon, request: dict) -> dict:
    code, answer = user.curl(service.socket, "POST", "/v1/datasets", request)
    assert code in (200, 202), answer
    code, status = user.curl(
        service.socket, "GET", f"/v1/datasets/{request['name']}/wait?timeout=60"
    )
    assert code == 200 and status["state"] == "ready", status
    return status


def state(user: User, service: Daemon, name: str) -> str:
    code, status = user.curl(service.socket, "GET", f"/v1/datasets/{name}")
    assert code == 200, status
    return status["state"]


def delete(user: User, service: Daemon, name: str) -> None:
    code, answer = user.curl(service.socket, "DELETE", f"/v1/datasets/{name}")
    assert code == 200, answer


@pytest.fixture
def homes(users: tuple[User, User], shared_tmp: Path) -> tuple[Path, Path]:
    made = []
    for user in users:
        folder = shared_tmp / f"home-{user.name}"
        folder.mkdir(mode=0o755)
        os.chown(folder, user.uid, user.gid)
        made.append(folder)
    return made[0], made[1]


@pytest.fixture
def service(users: tuple[User, User], shared_tmp: Path) -> Iterator[Daemon]:
    quota = ["--user-quota", str(QUOTA)]
    with node_service(shared_tmp / "cache", *quota, STAGER_SWEEP_INTERVAL_S=str(SWEEP_S)) as daemon:
        yield daemon


@contextmanager
def holders() -> Iterator[list[Popen[str]]]:
    """alice's processes, each holding a dataset; ended after the block whatever
    happens (so that no lazily unmounted image outlives the test)."""
    started: list[Popen[str]] = []
    try:
        yield started
    finally:
        for process in started:
            process.kill()
            process.wait(10)


def hold(user: User, started: list[Popen[str]], script: str, inside: Path) -> None:
    """Start ``script`` (sh) as ``user``, then wait until it holds ``inside``: its
    working folder is there, or one of its descriptors is open there."""
    process = user.popen(["sh", "-c", script])
    started.append(process)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        proc = Path(f"/proc/{process.pid}")
        try:
            links = [os.readlink(proc / "cwd")]
            links += [os.readlink(fd) for fd in (proc / "fd").iterdir()]
        except OSError:
            links = []
        if any(link.startswith(str(inside)) for link in links) and "sleep" in (
            (proc / "comm").read_text()
        ):
            return
        assert process.poll() is None, process.communicate()
        time.sleep(0.05)
    raise AssertionError(f"{script} never held {inside}")


def refused_as_held(user: User, service: Daemon, request: dict) -> str:
    code, answer = user.curl(service.socket, "POST", "/v1/datasets", request)
    assert code == 422 and answer["error"]["type"] == "quota_exceeded", answer
    message = answer["error"]["message"]
    assert "still held by your processes" in message and "close" in message, message
    return message


def admitted_within(user: User, service: Daemon, request: dict, seconds: float) -> dict:
    """Staged once the sweep has taken what was held off ``user``'s books."""
    deadline = time.monotonic() + seconds
    while True:
        code, answer = user.curl(service.socket, "POST", "/v1/datasets", request)
        if code in (200, 202) or time.monotonic() > deadline:
            break
        time.sleep(SWEEP_S)
    assert code in (200, 202), answer
    return staged(user, service, request)


@pytest.mark.parametrize("whose", ["private", "shared"])
def test_images_alice_holds_after_deleting_them_stay_on_her_books(
    users: tuple[User, User], homes: tuple[Path, Path], service: Daemon, whose: str
) -> None:
    """Her own images, or shared ones (on nobody's quota while ready): what she holds
    of them once deleted is charged to her, and stays so across a restart."""
    alice, bob = users
    kept = staged(bob, service, body("kept", private_tar(bob, homes[1], "kept", MIB), False))
    with holders() as started:
        for i in range(2):
            name = f"img{i}"
            archive = private_tar(alice, homes[0], name, 2 * MIB, whose == "private")
            status = staged(alice, service, body(name, archive, True))
            inside = Path(status["path"]) / name
            hold(alice, started, f"cd {inside} && exec sleep 600", inside)
            delete(alice, service, name)
            # Lazily unmounted: gone from the mount table at once, held all the same.
            assert image_mount.mounted_at(status["path"]) is None
        third = body("img2", private_tar(alice, homes[0], "img2", 2 * MIB), True)
        refused_as_held(alice, service, third)
        service.stop()  # a restart finds what is held again
        service.start()
        refused_as_held(alice, service, third)
        # bob's data stays, and his staging that fits goes on.
        more = staged(bob, service, body("more", private_tar(bob, homes[1], "more", MIB), False))
        assert state(bob, service, "kept") == "ready" and Path(kept["path"]).is_dir()
        assert Path(more["path"]).is_dir()
    # alice's processes have ended: the kernel frees the images, the sweep her books.
    admitted_within(alice, service, third, seconds=10)
    partial = service.cache_dir / "partial"
    assert not [p for p in partial.iterdir() if p.name.startswith("held-")]
    delete(alice, service, "img2")


def test_a_deleted_tree_whose_files_alice_keeps_open_stays_on_her_books(
    users: tuple[User, User], homes: tuple[Path, Path], service: Daemon
) -> None:
    alice, bob = users
    with holders() as started:
        for i in range(2):
            name = f"tree{i}"
            status = staged(
                alice, service, body(name, private_tar(alice, homes[0], name, 2 * MIB), False)
            )
            file = Path(status["path"]) / name / "blob.bin"
            hold(alice, started, f"exec 3< {file} && exec sleep 600", Path(status["path"]))
            delete(alice, service, name)
        partial = service.cache_dir / "partial"
        deadline = time.monotonic() + 10  # the deleted trees' background deletes
        while [p for p in partial.iterdir() if p.name.startswith("discarded-")]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        third = body("tree2", private_tar(alice, homes[0], "tree2", 2 * MIB), False)
        refused_as_held(alice, service, third)
        staged(bob, service, body("bobs", private_tar(bob, homes[1], "bobs", MIB), False))
    admitted_within(alice, service, third, seconds=10)


# ---- the books themselves, without a service -----------------------------------------


def test_open_files_of_a_deleted_tree_are_held_until_closed_and_found_again(
    tmp_path: Path,
) -> None:
    import shutil
    import subprocess

    folder = tmp_path / "discarded-k1-0123abcd"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "f").write_bytes(os.urandom(64 * 1024))
    (folder / "sub" / "closed").write_bytes(os.urandom(64 * 1024))
    holder = subprocess.Popen(["sh", "-c", f"exec 3< {folder}/sub/f && exec sleep 60"])
    try:
        deadline = time.monotonic() + 10
        while not os.path.exists(f"/proc/{holder.pid}/fd/3"):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        books = HeldSpace(tmp_path)
        books.watch_tree("k1", 1234, folder)
        assert 64 * 1024 <= books.bytes_of(1234) < 128 * 1024  # the open file alone
        shutil.rmtree(folder)
        assert books.sweep() == [] and books.bytes_of(1234) >= 64 * 1024
        again = HeldSpace(tmp_path)  # a restart: the owner is the entry's
        again.recover(lambda key: 99 if key == "k1" else None)
        assert again.bytes_of(99) >= 64 * 1024
    finally:
        holder.kill()
        holder.wait(10)
    assert [r.key for r in books.sweep()] == ["k1"] and books.total_bytes == 0


def test_a_held_image_is_found_again_by_its_name_and_deleted_once_nothing_holds_it(
    tmp_path: Path,
) -> None:
    image = tmp_path / "held-1234-somekey-0123abcd.erofs"
    image.write_bytes(b"i" * 1000)
    Path(f"{image}.blob").write_bytes(b"b" * 24)
    books = HeldSpace(tmp_path)
    books.recover(lambda key: None)
    assert [(r.key, r.owner, r.nbytes) for r in books.records] == [("somekey", 1234, 1024)]
    with open(image, "rb"):  # held open: a write lease is refused
        assert books.sweep() == [] and image.exists()
    assert len(books.sweep()) == 1 and list(tmp_path.iterdir()) == []
