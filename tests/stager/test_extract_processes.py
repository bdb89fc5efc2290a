"""Large plain tars extract on worker processes forked inside the staging process.

Through a real daemon: the bytes arrive intact (a tar of tars, too), and a daemon
killed with -9 mid-extraction leaves no extraction worker behind to keep writing
into the partial directory that the restarted daemon resumes in.
"""

from __future__ import annotations

import io
import random
import tarfile
import time
from pathlib import Path

import pytest

from stager.archive.extractor import PROCESS_MIN_BYTES
from tests.daemon import Daemon
from tests.processes import children_of, staging_processes
from tests.trees import digest

pytestmark = pytest.mark.forked_daemons  # its daemons: tests/daemon_zygote.py

FILE_BYTES = 256 * 1024


def big_tar(path: Path, tree: Path, total_bytes: int) -> Path:
    """A plain tar over ``PROCESS_MIN_BYTES`` of incompressible files, and its tree."""
    rng = random.Random(7)
    pool = rng.randbytes(FILE_BYTES * 4)
    with tarfile.open(path, "w") as tar:
        for i in range(total_bytes // FILE_BYTES):
            start = rng.randrange(0, len(pool) - FILE_BYTES)
            data = pool[start : start + FILE_BYTES]
            member = tree / f"class_{i % 7}" / f"img_{i:05d}.jpg"
            member.parent.mkdir(parents=True, exist_ok=True)
            member.write_bytes(data)
            info = tarfile.TarInfo(f"train/class_{i % 7}/img_{i:05d}.jpg")
            info.size, info.mtime = len(data), 1_600_000_000 + i
            tar.addfile(info, io.BytesIO(data))
    assert path.stat().st_size > PROCESS_MIN_BYTES
    return path


def test_a_large_tar_and_a_tar_of_tars_arrive_intact(daemon: Daemon, tmp_path: Path) -> None:
    archive = big_tar(tmp_path / "train.tar", tmp_path / "tree", PROCESS_MIN_BYTES + (8 << 20))
    outer = tmp_path / "outer.tar"
    with tarfile.open(outer, "w") as tar:
        tar.add(archive, arcname="part_a.tar")
        tar.add(archive, arcname="part_b.tar")
    steps = [
        {"op": "extract", "src": str(archive), "dst": "flat"},
        {"op": "extract", "src": str(outer), "dst": "nested", "nested": True},
    ]
    with daemon.client() as client:
        assert client.post("/v1/datasets", json={"name": "big", "steps": steps}).status_code == 202
        status = client.get("/v1/datasets/big/wait", params={"timeout": 120}).json()
    assert status["state"] == "ready", status["error"]
    root = Path(status["path"])
    expected = digest(tmp_path / "tree")
    for folder in ("flat/train", "nested/part_a/train", "nested/part_b/train"):
        assert digest(root / folder) == expected, folder
    assert status["progress"]["files_done"] == 3 * len(expected)
    mtime = (root / "flat/train/class_3/img_00003.jpg").stat().st_mtime
    assert mtime == 1_600_000_003


def test_extraction_workers_die_with_a_killed_daemon(daemon: Daemon, tmp_path: Path) -> None:
    archive = big_tar(tmp_path / "train.tar", tmp_path / "tree", 4 * PROCESS_MIN_BYTES)
    with daemon.client() as client:
        body = {"name": "big", "steps": [{"op": "extract", "src": str(archive)}]}
        assert client.post("/v1/datasets", json=body).status_code == 202
    # daemon -> fork server -> staging process -> extraction workers
    assert daemon.process is not None
    deadline, workers = time.monotonic() + 30, []
    while time.monotonic() < deadline and len(workers) < 2:
        workers = [w for s in staging_processes(daemon.process.pid) for w in children_of(s)]
        time.sleep(0.01)
    assert len(workers) >= 2, "the staging process should have forked extraction workers"
    daemon.kill()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(Path(f"/proc/{w}").exists() for w in workers):
        time.sleep(0.05)
    alive = [w for w in workers if Path(f"/proc/{w}/stat").exists()]
    # A zombie (state Z) has stopped: it only waits for init to reap it.
    running = [
        w for w in alive if Path(f"/proc/{w}/stat").read_text().rsplit(")")[1].split()[0] != "Z"
    ]
    assert running == [], "extraction workers outlived the daemon"
