"""Which filesystem a source is on (stager.fs.mounts), and what a copy from a
network filesystem does with it: NETWORK_IN_FLIGHT processes from the first file."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stager.fs import mounts
from stager.ops import copy
from stager.ops.base import OpContext
from stager.ops.copy import CopyStep
from stager.wire.progress import Progress
from tests.trees import digest, write_tree

SFTP_SERVER = "/usr/lib/openssh/sftp-server"


def test_tmpfs_and_the_root_filesystem_are_local() -> None:
    assert mounts.fs_type("/dev/shm") == "tmpfs"
    assert mounts.fs_type(os.path.realpath("/dev/shm/anything/below")) == "tmpfs"
    assert mounts.fs_type("/") not in ("", "tmpfs")
    assert not mounts.on_network("/dev/shm")
    assert not mounts.on_network("/")


def test_the_longest_mount_point_and_the_last_mount_on_it_win(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = tmp_path / "mountinfo"
    table.write_text(
        "1 0 8:1 / / rw - ext4 /dev/sda1 rw\n"
        "2 1 0:40 / /data rw shared:1 - nfs4 srv:/data rw,vers=4.2\n"
        "3 2 0:41 / /data/scratch rw - lustre 10.0.0.1@tcp:/fs rw\n"
        "4 1 0:42 / /data2 rw - tmpfs tmpfs rw\n"  # /data2 is not below /data
        "5 1 0:43 / /mnt/my\\040share rw - fuse.sshfs host:/x rw\n"
        "6 1 0:44 / /stacked rw - ext4 /dev/sdb rw\n"
        "7 6 0:45 / /stacked rw - cifs //srv/x rw\n"
    )
    monkeypatch.setattr(mounts, "MOUNTINFO", str(table))
    assert mounts.fs_type("/home/u") == "ext4"
    assert mounts.fs_type("/data") == "nfs4"
    assert mounts.fs_type("/data/imagenet/train") == "nfs4"
    assert mounts.fs_type("/data/scratch/x") == "lustre"
    assert mounts.fs_type("/data2/x") == "tmpfs"
    assert mounts.fs_type("/mnt/my share/x") == "fuse.sshfs"
    assert mounts.fs_type("/stacked/x") == "cifs"
    network = ["/data/x", "/data/scratch", "/mnt/my share", "/stacked"]
    assert [mounts.on_network(p) for p in network] == [True] * 4
    assert not mounts.on_network("/data2") and not mounts.on_network("/home")


@pytest.fixture
def sshfs_source(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """A real FUSE network filesystem: ``export`` mounted at ``mnt`` by sshfs, talking
    SFTP to a local sftp-server over pipes (no ssh, no network needed)."""
    if not (shutil.which("sshfs") and os.path.exists(SFTP_SERVER)):
        pytest.skip("needs sshfs and openssh-sftp-server (deploy/slurm/multinode installs them)")
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        pytest.skip("needs /dev/fuse")
    export, mnt = tmp_path / "export", tmp_path / "mnt"
    export.mkdir()
    mnt.mkdir()
    to_server, from_client = os.pipe()
    to_client, from_server = os.pipe()
    server = subprocess.Popen([SFTP_SERVER], stdin=to_server, stdout=from_server)
    client = subprocess.Popen(
        ["sshfs", "-f", "-o", "passive", f"localhost:{export}", str(mnt)],
        stdin=to_client,
        stdout=from_client,
    )
    for fd in (to_server, from_client, to_client, from_server):
        os.close(fd)
    try:
        deadline = time.monotonic() + 10
        while not os.path.ismount(mnt):
            assert client.poll() is None and time.monotonic() < deadline, "sshfs did not mount"
            time.sleep(0.05)
        yield export, mnt
    finally:
        if os.path.ismount(mnt):
            subprocess.run(["fusermount", "-u", str(mnt)], check=True)
        for proc in (client, server):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_an_sshfs_mount_is_a_network_filesystem(sshfs_source: tuple[Path, Path]) -> None:
    export, mnt = sshfs_source
    assert mounts.fs_type(str(mnt)) == "fuse.sshfs"
    assert mounts.on_network(str(mnt / "below"))
    assert not mounts.on_network(str(export))


# Where the workers note their pids: set before the workers fork, so they inherit it.
_pid_log = ""


def _copy_files_noting_pid(groups: list[Any], verify: str) -> None:
    """copy._copy_files, noting which process ran the chunk. The pause stands for a
    slow link's round trips, so that no process can take every chunk alone."""
    with open(_pid_log, "a") as log:
        log.write(f"{os.getpid()}\n")
    time.sleep(0.03)
    _real_copy_files(groups, verify)


_real_copy_files = copy._copy_files


def copy_counting_processes(
    src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Path, set[int]]:
    global _pid_log
    _pid_log = str(tmp_path / "pids")
    monkeypatch.setattr(copy, "_copy_files", _copy_files_noting_pid)
    root = tmp_path / "root"
    root.mkdir()
    ctx = OpContext(root=root, progress=Progress(), workers=16, verify="size")
    copy.run(CopyStep(src=str(src), dst="data"), ctx)
    pids = {int(line) for line in Path(_pid_log).read_text().split()}
    return root / "data", pids


def network_tree(root: Path) -> Path:
    # Four chunks per process: far fewer files than a local copy forks for.
    count = copy.NETWORK_IN_FLIGHT * copy.NETWORK_BATCH_FILES * 4
    assert count < copy.PARALLEL_AFTER_FILES
    return write_tree(root, n_files=count, max_size=2_000)


def test_a_copy_from_sshfs_runs_on_network_in_flight_processes_from_its_first_file(
    sshfs_source: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    export, mnt = sshfs_source
    network_tree(export / "tree")

    out, pids = copy_counting_processes(mnt / "tree", tmp_path, monkeypatch)

    assert os.getpid() not in pids  # not one chunk on the walking process
    assert len(pids) == copy.NETWORK_IN_FLIGHT
    assert digest(out) == digest(export / "tree")


def test_a_copy_from_a_source_classified_local_stays_on_the_walking_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = network_tree(tmp_path / "src")
    assert not mounts.on_network(str(src))

    out, pids = copy_counting_processes(src, tmp_path, monkeypatch)

    assert pids == {os.getpid()}  # a small local tree: no fork
    assert digest(out) == digest(src)


def test_a_source_classified_network_copies_on_network_in_flight_processes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = network_tree(tmp_path / "src")
    here = mounts.fs_type(str(src))
    monkeypatch.setattr(mounts, "NETWORK_TYPES", mounts.NETWORK_TYPES | {here})

    out, pids = copy_counting_processes(src, tmp_path, monkeypatch)

    assert os.getpid() not in pids
    assert len(pids) == copy.NETWORK_IN_FLIGHT
    assert digest(out) == digest(src)
