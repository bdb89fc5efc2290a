"""The node service counts every byte and inode a staging makes, against users who try
to make it spend more than their archive's size says: real users (tests/users.py)
staging small archives of deep folders, of empty folders, of empty files and of hard
links, as a tree and as an image.

None of them passes the user's byte quota, their inode quota, the disk's byte or inode
floor, or the bound on the staging process's memory; each fails with a sentence (never a
traceback), and what it made is deleted. Archives are made by GNU tar from trees made
here (a deep path by ``--transform``, so that the tree on this side stays shallow).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stager.archive.writer import MAX_DEPTH
from stager.core.processes import SPARE_NAME, STAGE_NAME
from tests.daemon import Daemon, node_service
from tests.httpserver import Behaviour, serve_files
from tests.processes import comm, descendants
from tests.users import User

MODES = [pytest.param(False, id="tree"), pytest.param(True, id="image")]


def request(user: User, service: Daemon, method: str, path: str, body: object = None):
    return user.curl(service.socket, method, path, body)


def stage_and_wait(user: User, service: Daemon, name: str, body: dict, timeout: int = 300) -> dict:
    code, answer = request(user, service, "POST", "/v1/datasets", {"name": name, **body})
    assert code in (200, 202), answer
    return wait_end(user, service, name, timeout)


def wait_end(user: User, service: Daemon, name: str, timeout: int = 300) -> dict:
    deadline = time.monotonic() + timeout
    while True:  # in waits shorter than a user's command may take (tests/users.py)
        code, status = request(user, service, "GET", f"/v1/datasets/{name}/wait?timeout=30")
        assert code == 200, status
        if status["state"] not in ("queued", "staging") or time.monotonic() > deadline:
            return status


def failed_with(status: dict, kind: str, *words: str) -> str:
    """The failure's message, checked to be a sentence of ``kind`` holding ``words``."""
    assert status["state"] == "failed", status
    error = status["error"]
    assert error["type"] == kind, error
    message = error["message"]
    assert "Traceback" not in message and "\n" not in message, message
    for word in words:
        assert word in message, message
    return message


def extract(archive: Path, image: bool) -> dict:
    return {"steps": [{"op": "extract", "src": str(archive)}], "image": image}


def hers(archive: Path, user: User) -> Path:
    """``archive`` made ``user``'s own, 0600: her staging of it is private data, which
    her quotas count (what every user may read is shared, and counts against nobody)."""
    os.chown(archive, user.uid, user.gid)
    archive.chmod(0o600)
    return archive


def gnu_tar(archive: Path, folder: Path, *members: str, transform: str = "") -> Path:
    """``archive`` (gzip, or xz for a name ending so: its size is not told before it is
    read, so admission estimates it at a fraction) of ``members`` of ``folder``, by GNU
    tar, readable by all. xz at its fastest level (-0): at its default (-6) the tar of
    20,000 empty entries took 1.2-1.5 s of CPU to compress, at -0 0.1 s, and the
    archive is still a few hundred KB."""
    kind = "-cJf" if archive.name.endswith(".xz") else "-czf"
    argv = ["tar", kind, str(archive), "-C", str(folder)]
    if transform:
        argv += ["--transform", transform]
    env = {**os.environ, "XZ_OPT": "-0"}
    subprocess.run([*argv, *members], check=True, capture_output=True, env=env)
    archive.chmod(0o644)
    return archive


def deep_folders(tmp: Path, chains: int, depth: int, component: str = "d") -> Path:
    """A small archive of ``chains`` paths, each ``depth`` folders deep (an empty file at
    the bottom): ``chains * depth`` folders from a few KB."""
    leaves = tmp / f"leaves-{chains}-{depth}-{len(component)}"
    leaves.mkdir()
    for i in range(chains):
        (leaves / f"c{i:04d}").touch()
    deep = "/".join([component] * (depth - 1))
    archive = tmp / f"deep-{chains}-{depth}-{len(component)}.tar.gz"
    names = sorted(p.name for p in leaves.iterdir())
    return gnu_tar(archive, leaves, *names, transform=rf"s|^\(c[0-9]*\)$|\1/{deep}/leaf|")


def empty_entries(tmp: Path, count: int, kind: str) -> Path:
    """A small archive of ``count`` empty files, empty folders or hard links to one
    empty file (named 96 bytes long: each costs its folder that much)."""
    folder = tmp / f"{kind}-{count}"
    folder.mkdir()
    for i in range(count):
        if kind == "files":
            (folder / f"f{i:06d}").touch()
        elif kind == "folders":
            (folder / f"d{i:06d}").mkdir()
        else:
            if i == 0:
                (folder / "target").touch()
            os.link(folder / "target", folder / f"{'l' * 90}{i:06d}")  # 96-byte names
    return gnu_tar(tmp / f"{kind}-{count}.tar.xz", folder, ".")


@pytest.fixture
def sources(shared_tmp: Path) -> Path:
    folder = shared_tmp / "sources"
    folder.mkdir(mode=0o755)
    return folder


@contextlib.contextmanager
def small_disk(shared_tmp: Path, size: str, inodes: int) -> Iterator[Path]:
    """A tmpfs of ``size`` bytes and ``inodes`` inodes: a real disk whose inodes run out."""
    point = shared_tmp / f"disk-{size}-{inodes}"
    point.mkdir()
    options = f"size={size},nr_inodes={inodes},mode=0755"
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)])
    if done.returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        yield point
    finally:
        subprocess.run(["umount", "-l", str(point)], check=False)


def cache_holds_nothing_of(service: Daemon) -> None:
    """What the failed stagings made is gone (their attempts deleted)."""
    partial = service.cache_dir / "partial"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if not [p for p in partial.iterdir() if not p.name.startswith(("trash", "discarded-"))]:
            return
        time.sleep(0.1)
    raise AssertionError(f"left in {partial}: {sorted(p.name for p in partial.iterdir())}")


# ---- the byte quota counts folders, entries and an image's metadata ---------------------


@pytest.mark.parametrize("image", MODES)
def test_a_few_kb_of_deep_folders_stop_at_the_byte_quota(
    users: tuple[User, User], shared_tmp: Path, sources: Path, image: bool
) -> None:
    """A 3 KB archive of 60 paths 100 folders deep makes 6,000 folders: 24 MB of folder
    blocks (a tree) or of the image's folder metadata, past alice's 4 MB quota; and
    50,000 hard links to one empty file cost their folder's entries (5 MB). (On f55a66a both
    were ready: folders, entries and metadata were not counted, the tree recorded at 0
    bytes.)"""
    alice, _ = users
    deep = hers(deep_folders(sources, chains=60, depth=100), alice)
    links = hers(empty_entries(sources, 50_000, "links"), alice)
    assert deep.stat().st_size < 10_000
    with node_service(shared_tmp / "cache-q", "--user-quota", "4M") as service:
        status = stage_and_wait(alice, service, "deep", extract(deep, image))
        failed_with(status, "quota_exceeded", "quota")
        status = stage_and_wait(alice, service, "links", extract(links, image))
        failed_with(status, "quota_exceeded", "quota")
        cache_holds_nothing_of(service)


# ---- the inode quota and the disk's inode floor ----------------------------------------------


def test_empty_files_and_folders_stop_at_the_inode_quota(
    users: tuple[User, User], shared_tmp: Path, sources: Path
) -> None:
    """Archives of 20,000 empty files or folders (a few dozen KB) make 20,000 inodes:
    they stop at alice's inode quota of 5,000, not at her byte quota, which they do not
    reach. (On f55a66a there was no inode quota: both were ready.)"""
    alice, _ = users
    files = hers(empty_entries(sources, 20_000, "files"), alice)
    folders = hers(empty_entries(sources, 20_000, "folders"), alice)
    limits = ("--user-quota", "1G", "--user-inode-quota", "5000")
    with node_service(shared_tmp / "cache-i", *limits) as service:
        for name, archive in (("files", files), ("folders", folders)):
            status = stage_and_wait(alice, service, name, extract(archive, False))
            failed_with(status, "quota_exceeded", "inode quota", "--user-inode-quota")
        cache_holds_nothing_of(service)


def test_empty_files_stop_at_the_disks_inode_floor_and_others_keep_their_data(
    users: tuple[User, User], shared_tmp: Path, sources: Path
) -> None:
    """On a cache disk of 30,000 inodes with a floor of 10,000, alice's 40,000 empty
    files stop at the floor (no quota applies), not at a disk out of inodes; bob's data
    staged before stays, and he can still stage. (On f55a66a the disk ran out of inodes:
    the staging failed at ENOSPC, taking the floor every other staging needs.)"""
    alice, bob = users
    files = empty_entries(sources, 40_000, "files")
    small = sources / "small"
    small.mkdir()
    (small / "a.bin").write_bytes(b"bob's" * 100)
    os.chmod(small, 0o755)
    with small_disk(shared_tmp, "256m", 30_000) as disk:
        with node_service(disk / "cache", "--min-free-inodes", "10000") as service:
            copy = {"steps": [{"op": "copy", "src": str(small)}]}
            assert stage_and_wait(bob, service, "kept", copy)["state"] == "ready"
            status = stage_and_wait(alice, service, "many", extract(files, False))
            failed_with(status, "insufficient_space", "--min-free-inodes")
            assert os.statvfs(disk).f_favail >= 9_000
            code, kept = request(bob, service, "GET", "/v1/datasets/kept")
            assert kept["state"] == "ready", kept
            assert stage_and_wait(bob, service, "again", copy)["state"] == "ready"
            cache_holds_nothing_of(service)


def test_an_images_metadata_stops_at_the_disks_byte_floor(
    users: tuple[User, User], shared_tmp: Path, sources: Path
) -> None:
    """A world-readable image of 12,000 folders holds 50 MB of folder metadata: on a
    64 MiB disk with a 32 MiB floor it stops at the floor. (On f55a66a the image was
    built and left the disk far below its floor: only file content was counted.)"""
    alice, _ = users
    deep = deep_folders(sources, chains=120, depth=100)
    with small_disk(shared_tmp, "64m", 100_000) as disk:
        with node_service(disk / "cache", "--min-free-bytes", "32M") as service:
            status = stage_and_wait(alice, service, "deep", extract(deep, True))
            failed_with(status, "insufficient_space", "above its floor")
            cache_holds_nothing_of(service)


# ---- the staging process's memory is bounded ---------------------------------------------


class PeakMemory:
    """The highest resident memory (VmHWM) of the service's staging processes seen while
    the block runs, less what the idle spare one held before it (its parent's pages)."""

    def __init__(self, service: Daemon) -> None:
        self.service = service
        spares = self._named(SPARE_NAME)
        self.base = max((self._status(pid)[1] for pid in spares), default=0)
        self.peak = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _named(self, name: str) -> list[int]:
        assert self.service.process is not None
        return [pid for pid in descendants(self.service.process.pid) if comm(pid) == name]

    @staticmethod
    def _status(pid: int) -> tuple[int, int]:
        """(VmHWM, VmRSS) of ``pid`` in bytes; zeros once it is gone."""
        found = {"VmHWM": 0, "VmRSS": 0}
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                key, _, value = line.partition(":")
                if key in found:
                    found[key] = int(value.split()[0]) * 1024
        return found["VmHWM"], found["VmRSS"]

    def _watch(self) -> None:
        while not self._done.is_set():
            for pid in self._named(STAGE_NAME):
                self.peak = max(self.peak, self._status(pid)[0])
            time.sleep(0.02)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()

    @property
    def grew(self) -> int:
        return self.peak - self.base


def spare_is_up(service: Daemon, timeout: float = 30) -> None:
    """Until the spare staging process, forked after the start, is there and named (its
    memory is the base the bound is measured from); polled, not a fixed wait of 2 s."""
    assert service.process is not None
    deadline = time.monotonic() + timeout
    while not [p for p in descendants(service.process.pid) if comm(p) == SPARE_NAME]:
        assert time.monotonic() < deadline, f"no {SPARE_NAME} process after {timeout} s"
        time.sleep(0.05)


@pytest.mark.parametrize("image", MODES)
def test_deep_folders_cannot_grow_the_staging_process_past_its_bound(
    users: tuple[User, User], shared_tmp: Path, sources: Path, image: bool
) -> None:
    """An archive of 200 paths 500 folders deep, of 8-byte names (4 KB paths: 200 MB of
    folder paths in all), under no quota: the staging process keeps the names of at
    most 64 MiB of folders, then the staging fails naming a member and the bound. (On
    f55a66a it kept every folder's full path: 200 MB and more.)"""
    alice, _ = users
    deep = deep_folders(sources, chains=200, depth=500, component="ddddddd")
    assert deep.stat().st_size < 200_000
    with node_service(shared_tmp / "cache-m") as service:
        spare_is_up(service)
        with PeakMemory(service) as memory:
            status = stage_and_wait(alice, service, "deep", extract(deep, image), timeout=300)
        failed_with(status, "unsafe_member", "MiB of", "c0")
        assert memory.base > 0, "no staging process was seen"
        assert memory.grew < 110 << 20, (memory.base, memory.peak)
        cache_holds_nothing_of(service)


# ---- a path too deep is refused by name, never a traceback ------------------------------


@pytest.mark.parametrize("image", MODES)
def test_a_path_deeper_than_the_limit_is_refused_with_a_sentence(
    users: tuple[User, User], shared_tmp: Path, sources: Path, image: bool
) -> None:
    """A member 990 folders deep (under 4,095 bytes) is refused naming the member and
    the limit; one just within the limit is staged. (On f55a66a the 990-deep member hit
    a RecursionError and alice was sent the staging's traceback.)"""
    alice, _ = users
    too_deep = deep_folders(sources, chains=1, depth=990)
    within = deep_folders(sources, chains=2, depth=MAX_DEPTH - 1)
    with node_service(shared_tmp / "cache-d") as service:
        status = stage_and_wait(alice, service, "deep", extract(too_deep, image))
        failed_with(status, "unsafe_member", f"past the {MAX_DEPTH}", "c0000/d/d")
        status = stage_and_wait(alice, service, "within", extract(within, image))
        assert status["state"] == "ready", status


# ---- copies and link trees count their folders and names too ----------------------------


def her_tree(sources: Path, user: User, name: str, folders: int, files: int) -> Path:
    """A tree of ``user``'s own (0700: her stagings of it are private): ``folders``
    folders of ``files`` empty files each."""
    top = sources / name
    top.mkdir()
    for i in range(folders):
        folder = top / f"d{i:04d}"
        folder.mkdir()
        for j in range(files):
            (folder / f"f{j:05d}").touch()
    subprocess.run(["chown", "-R", f"{user.uid}:{user.gid}", str(top)], check=True)
    top.chmod(0o700)
    return top


def walked(op: str, src: Path) -> dict:
    if op == "copy":
        return {"steps": [{"op": "copy", "src": str(src)}]}
    return {"steps": [{"op": "symlink", "src": str(src), "mode": "tree", "dst": "t"}]}


WALKERS = [pytest.param("copy", id="copy"), pytest.param("symlink", id="symlink-tree")]


@pytest.mark.parametrize("op", WALKERS)
def test_a_copy_or_link_tree_stops_at_the_inode_and_byte_quotas(
    users: tuple[User, User], shared_tmp: Path, sources: Path, op: str
) -> None:
    """A copy or a link tree of her 3,030 empty files and folders stops at alice's inode
    quota of 1,000; one of 300 empty folders (1.2 MB of folder blocks, no content) at
    her byte quota of 1 MB. (Before, copy and symlink counted no inode and no folder:
    3,030 entries were counted as 0 inodes and 0 bytes, and both were ready.)"""
    alice, _ = users
    many = her_tree(sources, alice, "many", folders=30, files=100)
    folders = her_tree(sources, alice, "folders", folders=300, files=0)
    limits = ("--user-quota", "1M", "--user-inode-quota", "1000")
    with node_service(shared_tmp / "cache-w", *limits) as service:
        status = stage_and_wait(alice, service, "many", walked(op, many))
        failed_with(status, "quota_exceeded", "inode quota", "--user-inode-quota")
        status = stage_and_wait(alice, service, "folders", walked(op, folders))
        failed_with(status, "quota_exceeded", "--user-quota")
        cache_holds_nothing_of(service)


def test_two_stagings_of_one_user_together_stay_within_her_inode_quota(
    users: tuple[User, User], shared_tmp: Path, sources: Path
) -> None:
    """alice starts two stagings at once, each a held download and then a link tree of
    3,030 names: each alone is within her inode quota of 5,000, both together are not.
    Both start before either has made anything, so each was given the whole quota: one
    fails naming the quota, and what stays is within it. (Before, each counted only
    what the other had made when it started: both were ready, 6,000 inodes.)"""
    alice, _ = users
    many = her_tree(sources, alice, "many", folders=30, files=100)
    hold = threading.Event()
    files = {"/a.bin?x": b"a" * 1000, "/b.bin?x": b"b" * 1000}
    limits = ("--max-workers", "3", "--user-inode-quota", "5000")
    with serve_files(Behaviour(files=files, hold=hold)) as base:
        with node_service(shared_tmp / "cache-2", *limits) as service:
            for name in ("a", "b"):
                steps = [{"op": "fetch", "url": f"{base}/{name}.bin?x", "dst": "s"}]
                steps += walked("symlink", many)["steps"]
                code, answer = request(
                    alice, service, "POST", "/v1/datasets", {"name": name, "steps": steps}
                )
                assert code in (200, 202), answer
            until_staging(alice, service, "a", "b")
            hold.set()
            ends = [wait_end(alice, service, name) for name in ("a", "b")]
            states = sorted(end["state"] for end in ends)
            assert states == ["failed", "ready"], ends
            failed = next(end for end in ends if end["state"] == "failed")
            failed_with(failed, "quota_exceeded", "inode quota")


def until_staging(user: User, service: Daemon, *names: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = [request(user, service, "GET", f"/v1/datasets/{n}")[1]["state"] for n in names]
        if all(state == "staging" for state in states):
            return
        time.sleep(0.1)
    raise AssertionError(f"{names} are not all staging: {states}")


def test_the_inode_floor_is_met_by_evicting_an_unleased_dataset(
    users: tuple[User, User], shared_tmp: Path, sources: Path
) -> None:
    """bob's unleased dataset of empty files leaves the disk a few hundred inodes above
    its floor; alice's link tree of 2,020 names is admitted by evicting it (least
    recently used, nobody holds it), as bytes would be, and is ready. (Before, nothing
    evicted for inodes: her staging failed at the floor until root ran gc.)"""
    alice, bob = users
    mine = her_tree(sources, alice, "mine", folders=20, files=100)
    with small_disk(shared_tmp, "256m", 22_000) as disk:
        with node_service(disk / "cache", "--min-free-inodes", "5000") as service:
            count = os.statvfs(disk).f_favail - 5000 - 600
            files = empty_entries(sources, count, "files")
            status = stage_and_wait(bob, service, "old", extract(files, False))
            assert status["state"] == "ready", status
            assert os.statvfs(disk).f_favail - 5000 < 1000
            status = stage_and_wait(alice, service, "mine", walked("symlink", mine))
            assert status["state"] == "ready", status
            code, old = request(bob, service, "GET", "/v1/datasets/old")
            assert old["state"] == "evicted", old
