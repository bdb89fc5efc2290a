"""Image mode in a user's own daemon (no root): images are mounted with FUSE as the
user. On Debian 12 no FUSE reader of EROFS exists, so an image the daemon would build
is refused in one sentence, or staged as a tree where the request allows it; a
prebuilt squashfs is mounted with squashfuse_ll, read, and evicted by fusermount3."""

from __future__ import annotations

import io
import os
import shutil
import signal
import subprocess
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stager.image import mount as image_mount
from tests.daemon import Daemon, stage_ready
from tests.trees import digest, make_tar, write_tree
from tests.users import User


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
    if shutil.which("erofsfuse") or shutil.which("squashfuse_ll"):
        pytest.skip("a FUSE reader is installed here: the user's daemon builds an image")
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
    writer = ["tar2sqfs", "-q"] if shutil.which("tar2sqfs") else None
    if writer is None and shutil.which("sqfstar"):  # squashfs-tools 4.6+
        writer = ["sqfstar", "-quiet", "-no-progress", "-no-duplicates"]
    if writer is None or shutil.which("squashfuse_ll") is None:
        pytest.skip("needs squashfs-tools-ng (or squashfs-tools 4.6+) and squashfuse")
    alice, _ = users
    tree = write_tree(shared_tmp / "t", n_files=5)
    archive = make_tar(tree, shared_tmp / "t.tar")
    image = shared_tmp / "t.sqfs"
    with open(archive, "rb") as stream:
        subprocess.run([*writer, str(image)], stdin=stream, check=True)
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


def _files(user: User, folder: Path) -> str:
    """Every file's sha256 under ``folder``, read as ``user`` (a FUSE mount is its
    user's alone: root is refused)."""
    listing = f"cd {folder} && find . -type f -print0 | sort -z | xargs -0 sha256sum"
    done = user.run(["bash", "-o", "pipefail", "-c", listing])
    assert done.returncode == 0, done.stderr
    return done.stdout


def _fuse_mounts(cache: Path) -> list[str]:
    return [m.target for m in image_mount.mounts_under(str(cache)) if m.fstype.startswith("fuse")]


def _stop(daemon: Daemon) -> None:
    """SIGTERM, which runuser passes on, then raises again on itself once the daemon
    has stopped (its own status, -15)."""
    assert daemon.stop() in (0, -signal.SIGTERM), daemon.log()
    assert "Traceback" not in daemon.log(None), daemon.log()


def _kill_9(daemon: Daemon) -> None:
    """A kill -9 of the daemon itself, runuser's child (a SIGKILL of runuser would leave
    it running); runuser then ends."""
    assert daemon.process is not None
    pid = daemon.process.pid
    child = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    os.kill(int(child[0]), signal.SIGKILL)
    daemon.process.wait(timeout=15)


def _servers(target: str) -> list[int]:
    """The squashfuse_ll processes serving ``target``."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[0].endswith(b"squashfuse_ll") and target.encode() in argv:
            found.append(int(proc.name))
    assert found, f"no squashfuse_ll serves {target}"
    return found


@pytest.mark.skipif(
    shutil.which("erofsfuse") is not None
    or not all(shutil.which(t) for t in ("squashfuse_ll", "fusermount3")),
    reason="needs Debian 12's squashfs kind: squashfuse_ll, fuse3, no erofsfuse",
)
def test_a_users_daemon_stages_a_tar_as_squashfs_and_leaves_no_mount(
    fuse_for_users: None, users: tuple[User, User], shared_tmp: Path, interpreter_for_users: str
) -> None:
    """A per-user daemon, started as a login would (runuser), stages a GNU tar as a
    squashfs image mounted with squashfuse_ll; its files read back as ``tar -xf``
    leaves them; an eviction, a stop, and a kill -9 then a restart leave no mount."""
    alice, _ = users
    tree = write_tree(shared_tmp / "src" / "t", n_files=60, max_size=300_000)
    (tree / "deep" / ("d" * 120)).mkdir(parents=True)  # a long name: GNU tar's own record
    (tree / "deep" / ("d" * 120) / ("n" * 130)).write_bytes(b"long")
    os.symlink("../class_0/img_0000.jpg", tree / "deep" / "link")
    archive = shared_tmp / "t.tar"
    subprocess.run(["tar", "-cf", str(archive), "-C", str(tree.parent), "t"], check=True)
    expected = shared_tmp / "expected"
    expected.mkdir()
    subprocess.run(["tar", "-xf", str(archive), "-C", str(expected)], check=True)
    owned(shared_tmp, alice)
    cache = shared_tmp / "cache"
    daemon = Daemon(cache_dir=cache, wrapper=["runuser", "-u", alice.name, "--"])
    os.chown(daemon.runtime_dir, alice.uid, alice.gid)
    body = {"name": "sq", "steps": [{"op": "extract", "src": str(archive)}], "image": True}
    try:
        daemon.start()
        with daemon.client() as client:
            status = stage_ready(client, body, timeout=60)
            image = status.image
            assert image is not None and (image.format, image.mount) == ("squashfs", "fuse")
            assert _fuse_mounts(cache) == [status.path]
            assert _files(alice, Path(status.path)) == _files(alice, expected)
            link = alice.run(["readlink", f"{status.path}/t/deep/link"])
            assert link.stdout.strip() == "../class_0/img_0000.jpg"
            began = time.monotonic()
            assert client.delete("/v1/datasets/sq").status_code == 200
            assert time.monotonic() - began < 1.0
            assert _fuse_mounts(cache) == [] and not Path(image.file).exists()
            status = stage_ready(client, body, timeout=60)
        _stop(daemon)
        assert _fuse_mounts(cache) == [], "the stop left a FUSE mount"
        daemon.start()  # mounted again at the start
        with daemon.client() as client:
            status = stage_ready(client, body)
            assert _fuse_mounts(cache) == [status.path]
        _kill_9(daemon)
        assert _fuse_mounts(cache) == [status.path]  # squashfuse_ll outlives a kill -9
        daemon.start()
        with daemon.client() as client:
            status = stage_ready(client, body)
            assert _files(alice, Path(status.path)) == _files(alice, expected)
        # A kill -9 that takes the mount's server too (a job's cgroup): the mount stays,
        # dead (ENOTCONN), and the next start mounts the image again.
        _kill_9(daemon)
        for pid in _servers(status.path):
            os.kill(pid, signal.SIGKILL)
        assert _fuse_mounts(cache) == [status.path]
        daemon.start()
        with daemon.client() as client:
            status = stage_ready(client, body)
            assert _files(alice, Path(status.path)) == _files(alice, expected)
        _stop(daemon)
        assert _fuse_mounts(cache) == [], "a restart after a kill -9 left a FUSE mount"
    finally:
        if daemon.process is not None and daemon.process.poll() is None:
            daemon.stop()  # runuser passes SIGTERM on; a SIGKILL of it would not be
        daemon.cleanup()


@pytest.mark.skipif(
    shutil.which("erofsfuse") is not None
    or not all(shutil.which(t) for t in ("squashfuse_ll", "fusermount3")),
    reason="needs Debian 12's squashfs kind: squashfuse_ll, fuse3, no erofsfuse",
)
def test_a_users_daemon_names_its_mounts_so_that_nobody_learns_what_they_hold(
    fuse_for_users: None, users: tuple[User, User], shared_tmp: Path, interpreter_for_users: str
) -> None:
    """alice's own daemon mounts her squashfs image with FUSE. The mount table and
    squashfuse_ll's command line, which every user reads, show it behind a gate named
    by her daemon's secret (``data/u/<G>/dataset``, stager.state.layout), never at
    ``data/<key>``, a hash of the request bob can work out; her cache is hers alone, so
    bob stats nothing in it. An image an earlier release left at ``data/<key>.sqfs``
    is moved behind its gate at the start and served as a hit."""
    alice, bob = users
    tree = write_tree(shared_tmp / "src" / "t", n_files=5, seed=7)
    archive = make_tar(tree, shared_tmp / "t.tar")
    owned(shared_tmp, alice)
    cache = shared_tmp / "cache"
    daemon = Daemon(cache_dir=cache, wrapper=["runuser", "-u", alice.name, "--"])
    os.chown(daemon.runtime_dir, alice.uid, alice.gid)
    body = {"name": "sq", "steps": [{"op": "extract", "src": str(archive)}], "image": True}
    public = "cat /proc/self/mountinfo /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '"
    try:
        daemon.start()
        with daemon.client() as client:
            status = stage_ready(client, body, timeout=60)
        assert status.image is not None and status.image.format == "squashfs"
        path, file = Path(status.path), Path(status.image.file)
        assert (path.parent.parent, path.name) == (cache / "data" / "u", "dataset"), path
        assert _fuse_mounts(cache) == [status.path]
        seen = bob.run(["sh", "-c", public]).stdout
        # Listed, the mount point and the file squashfuse_ll serves: their names must
        # say nothing.
        assert status.path in seen and str(file) in seen
        assert status.key not in seen
        assert bob.run(["stat", status.path]).returncode != 0

        # Where the release before put it: the image at data/<key>.sqfs.
        _stop(daemon)
        old = cache / "data" / f"{status.key}.sqfs"
        os.rename(file, old)
        os.rmdir(path)
        os.rmdir(path.parent)
        daemon.start()
        with daemon.client() as client:
            again = stage_ready(client, body)
            assert again.origin is not None and again.origin.hit, again
            assert again.path == status.path and not os.path.lexists(old)
            assert _files(alice, path) == _files(alice, tree.parent)
        _stop(daemon)
        assert _fuse_mounts(cache) == []
    finally:
        if daemon.process is not None and daemon.process.poll() is None:
            daemon.stop()
        daemon.cleanup()


@pytest.mark.skipif(
    shutil.which("erofsfuse") is not None
    or not all(shutil.which(t) for t in ("squashfuse_ll", "fusermount3")),
    reason="needs Debian 12's squashfs kind: squashfuse_ll, fuse3, no erofsfuse",
)
def test_a_users_daemon_streams_a_compressed_tar_under_a_folder_into_squashfs(
    fuse_for_users: None, users: tuple[User, User], alices_daemon: Daemon, shared_tmp: Path
) -> None:
    """A request that is not one plain tar at the top (a .tar.gz, under a folder) is
    read into the image as it is decompressed, as an EROFS image's is, with no tree
    on the disk: the same files, mounted as the user."""
    alice, _ = users
    tree = write_tree(shared_tmp / "src" / "t", n_files=12)
    archive = shared_tmp / "t.tar.gz"
    subprocess.run(["tar", "-czf", str(archive), "-C", str(tree.parent), "t"], check=True)
    owned(shared_tmp, alice)
    step = {"op": "extract", "src": str(archive), "dst": "under"}
    with alices_daemon.client() as client:
        status = stage_ready(client, {"name": "gz", "steps": [step], "image": True})
        assert status.image is not None and status.image.format == "squashfs"
        assert _files(alice, Path(status.path) / "under") == _files(alice, tree.parent)
        assert client.delete("/v1/datasets/gz").status_code == 200
    assert _fuse_mounts(alices_daemon.cache_dir) == []


@pytest.mark.skipif(
    shutil.which("erofsfuse") is not None
    or not all(shutil.which(t) for t in ("squashfuse_ll", "fusermount3")),
    reason="needs Debian 12's squashfs kind: squashfuse_ll, fuse3, no erofsfuse",
)
def test_a_tar_member_that_climbs_out_fails_the_squashfs_staging(
    fuse_for_users: None, users: tuple[User, User], alices_daemon: Daemon, shared_tmp: Path
) -> None:
    """A member that climbs out (``../x``) fails the staging, by extraction's rules,
    naming the member, and leaves no mount (tar2sqfs skipped it unless told not to,
    and sqfstar placed it inside the image)."""
    alice, _ = users
    archive = shared_tmp / "evil.tar"
    with tarfile.open(archive, "w") as tar:
        for name in ("ok.txt", "../evil.txt"):
            member = tarfile.TarInfo(name)
            member.size = 1
            tar.addfile(member, io.BytesIO(b"x"))
    owned(shared_tmp, alice)
    body = {"name": "evil", "steps": [{"op": "extract", "src": str(archive)}], "image": True}
    with alices_daemon.client() as client:
        assert client.post("/v1/datasets", json=body).status_code in (200, 202)
        status = client.get("/v1/datasets/evil/wait", params={"timeout": 60}).json()
    assert status["state"] == "failed", status
    assert status["error"]["type"] == "unsafe_member", status["error"]
    assert "../evil.txt" in status["error"]["message"], status["error"]
    assert _fuse_mounts(alices_daemon.cache_dir) == []
