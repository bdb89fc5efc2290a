"""The node cache through a real daemon: sharing, reuse, leases, capacity, ENOSPC."""

from __future__ import annotations

import io
import os
import re
import subprocess
import tarfile
import time
import zipfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.daemon import Daemon
from tests.httpserver import Behaviour, serve_files
from tests.trees import digest, make_tar, wait_until_empty, write_tree

pytestmark = pytest.mark.forked_daemons  # its daemons: tests/daemon_zygote.py


def metric(client: httpx.Client, name: str, **labels: str) -> float:
    text = client.get("/metrics").text
    selector = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = rf"^{re.escape(name)}{re.escape('{' + selector + '}') if labels else ''} (\S+)$"
    found = re.search(pattern, text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def ready(client: httpx.Client, body: dict) -> dict:
    response = client.post("/v1/datasets", json=body)
    assert response.status_code in (200, 202), response.text
    status = client.get(f"/v1/datasets/{body['name']}/wait", params={"timeout": 60}).json()
    assert status["state"] == "ready", status["error"]
    return status


def copy_body(name: str, src: Path, **extra: object) -> dict:
    return {"name": name, "steps": [{"op": "copy", "src": str(src)}], **extra}


def test_fifty_concurrent_identical_requests_share_one_staging(
    daemon: Daemon, tmp_path: Path
) -> None:
    src = write_tree(tmp_path / "src", n_files=300)
    body = copy_body("shared", src)

    def post(_: int) -> int:
        with daemon.client() as client:
            return client.post("/v1/datasets", json=body).status_code

    with ThreadPoolExecutor(50) as pool:
        codes = list(pool.map(post, range(50)))
    assert set(codes) <= {200, 202}
    with daemon.client() as client:
        status = client.get("/v1/datasets/shared/wait", params={"timeout": 60}).json()
        assert status["state"] == "ready"
        assert metric(client, "stager_requests_total", outcome="miss") == 1
        joins = metric(client, "stager_requests_total", outcome="join")
        hits = metric(client, "stager_requests_total", outcome="hit")
        assert joins + hits == 49
    assert [p.name for p in (daemon.cache_dir / "data").iterdir()] == [status["key"]]
    assert digest(Path(status["path"])) == digest(src)


def test_other_names_for_the_same_content_join_the_same_entry(
    daemon: Daemon, tmp_path: Path
) -> None:
    src = write_tree(tmp_path / "src", n_files=20)
    with daemon.client() as client:
        first = ready(client, copy_body("a", src))
        second = client.post("/v1/datasets", json=copy_body("b", src))
        assert second.status_code == 200 and second.json()["key"] == first["key"]


def test_after_a_restart_the_same_request_is_a_hit(daemon: Daemon, tmp_path: Path) -> None:
    src = write_tree(tmp_path / "src", n_files=20)
    with daemon.client() as client:
        first = ready(client, copy_body("ds", src))
    daemon.restart()
    with daemon.client() as client:
        t0 = time.monotonic()
        again = client.post("/v1/datasets", json=copy_body("ds", src))
        assert again.status_code == 200 and again.json()["state"] == "ready"
        assert time.monotonic() - t0 < 2
        assert again.json()["path"] == first["path"]
        assert metric(client, "stager_requests_total", outcome="hit") == 1
        assert metric(client, "stager_requests_total", outcome="miss") == 0


def test_a_touched_source_is_staged_afresh_and_the_old_copy_becomes_evictable(
    daemon: Daemon, tmp_path: Path
) -> None:
    archive = make_tar(write_tree(tmp_path / "train", n_files=10), tmp_path / "train.tar")
    body = {"name": "ds", "steps": [{"op": "extract", "src": str(archive)}]}
    with daemon.client() as client:
        old = ready(client, body)
        stat = archive.stat()
        os.utime(archive, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
        response = client.post("/v1/datasets", json=body)
        assert response.status_code == 202  # staged again, not a hit
        new = client.get("/v1/datasets/ds/wait", params={"timeout": 60}).json()
        assert new["state"] == "ready" and new["key"] != old["key"]
        assert Path(old["path"]).exists()  # kept until evicted
        result = client.post("/v1/gc", json={}).json()
        assert result["evicted"] == [old["key"]] and result["freed_bytes"] > 0
        assert not Path(old["path"]).exists() and Path(new["path"]).exists()


def test_deep_fingerprint_sees_a_file_touched_deep_in_a_tree(
    daemon: Daemon, tmp_path: Path
) -> None:
    src = write_tree(tmp_path / "src", n_files=10)
    body = copy_body("ds", src, fingerprint="deep")
    with daemon.client() as client:
        old = ready(client, body)
        deep_file = src / "class_1" / "img_0001.jpg"
        deep_file.write_bytes(b"changed")
        new = ready(client, body)
    assert new["key"] != old["key"]
    assert (Path(new["path"]) / "class_1" / "img_0001.jpg").read_bytes() == b"changed"


def test_leased_entry_survives_eviction_while_an_unleased_older_one_goes(
    daemon_factory, tmp_path: Path
) -> None:
    daemon = daemon_factory(env={"STAGER_CAPACITY_BYTES": str(3_000_000)})
    trees = [
        write_tree(tmp_path / f"src{i}", n_files=60, seed=i, max_size=40_000) for i in range(3)
    ]
    with daemon.client() as client:
        leased = ready(client, copy_body("leased", trees[0], lease={"holder": "job-1"}))
        older = ready(client, copy_body("unleased", trees[1]))
        assert leased["size_bytes"] + older["size_bytes"] < 3_000_000
        assert leased["size_bytes"] + older["size_bytes"] * 2 > 3_000_000
        newest = ready(client, copy_body("newest", trees[2]))
        states = {d["name"]: d["state"] for d in client.get("/v1/datasets").json()["data"]}
        assert states == {"leased": "ready", "unleased": "evicted", "newest": "ready"}
        assert metric(client, "stager_evictions_total") == 1
        assert not Path(older["path"]).exists()
        assert digest(Path(leased["path"])) == digest(trees[0])
        assert digest(Path(newest["path"])) == digest(trees[2])


def test_delete_of_a_leased_dataset_is_refused_naming_the_holders(
    daemon: Daemon, tmp_path: Path
) -> None:
    src = write_tree(tmp_path / "src", n_files=5)
    with daemon.client() as client:
        ready(client, copy_body("ds", src, lease={"holder": "job-7", "slurm_job_id": "7"}))
        lease = client.post("/v1/datasets/ds/leases", json={"holder": "job-8"}).json()
        refused = client.delete("/v1/datasets/ds")
        assert refused.status_code == 409
        assert "job-7" in refused.json()["error"]["message"]
        assert "job-8" in refused.json()["error"]["message"]
        client.delete(f"/v1/datasets/ds/leases/{lease['id']}")
        released = client.delete("/v1/leases", params={"holder": "job-7"}).json()
        assert [item["holder"] for item in released] == ["job-7"]
        assert client.get("/v1/datasets/ds").json()["leases"] == []
        assert client.delete("/v1/datasets/ds").json()["state"] == "evicted"


def test_a_lease_holds_the_data_whatever_other_names_share_it(
    daemon: Daemon, tmp_path: Path
) -> None:
    """``n1`` and ``n2`` show one entry; ``n2`` is leased. Cancelling ``n2`` is refused
    (the name and its lease stay), cancelling ``n1`` removes only that name and says so,
    and the data stays ready for ``n2``; gc --all leaves it too. Once released, ``n2``'s
    cancel evicts it."""
    src = write_tree(tmp_path / "src", n_files=5)
    with daemon.client() as client:
        first = ready(client, copy_body("n1", src))
        second = ready(client, copy_body("n2", src, lease={"holder": "me"}))
        assert first["key"] == second["key"]
        refused = client.delete("/v1/datasets/n2")
        assert refused.status_code == 409, refused.text
        assert "leased by me" in refused.json()["error"]["message"]
        assert client.get("/v1/datasets/n2").json()["leases"][0]["holder"] == "me"
        gone = client.delete("/v1/datasets/n1").json()
        assert gone["outcome"] == (
            "removed the name 'n1'; its data stays (ready): 1 other name(s) on this node use it"
        )
        assert client.get("/v1/datasets/n1").status_code == 404
        client.post("/v1/gc", json={"all": True})
        status = client.get("/v1/datasets/n2").json()
        assert status["state"] == "ready" and digest(Path(status["path"])) == digest(src)
        client.delete("/v1/leases", params={"holder": "me"})
        evicted = client.delete("/v1/datasets/n2").json()
        assert evicted["state"] == "evicted" and "evicted 'n2'" in evicted["outcome"]
        assert not Path(status["path"]).exists()


def test_a_request_larger_than_the_capacity_fails_fast_naming_the_sizes(
    daemon_factory, tmp_path: Path
) -> None:
    daemon = daemon_factory(env={"STAGER_CAPACITY_BYTES": str(100_000)})
    src = write_tree(tmp_path / "src", n_files=40)
    with daemon.client() as client:
        t0 = time.monotonic()
        response = client.post("/v1/datasets", json=copy_body("big", src))
        assert time.monotonic() - t0 < 2
    assert response.status_code == 422
    message = response.json()["error"]["message"]
    assert "cache limit of 97.7 KiB" in message and "KiB" in message.split("needs about")[1]


def test_an_expired_lease_is_dropped_by_the_sweep(daemon_factory, tmp_path: Path) -> None:
    daemon = daemon_factory(env={"STAGER_SWEEP_INTERVAL_S": "0.3"})
    src = write_tree(tmp_path / "src", n_files=5)
    with daemon.client() as client:
        ready(client, copy_body("ds", src))
        client.post("/v1/datasets/ds/leases", json={"holder": "short", "ttl_s": 0.5})
        client.post("/v1/datasets/ds/leases", json={"holder": "long", "ttl_s": 3600})
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            holders = [lease["holder"] for lease in client.get("/v1/datasets/ds").json()["leases"]]
            if holders == ["long"]:
                break
            time.sleep(0.1)
    assert holders == ["long"]


def test_enospc_mid_staging_fails_cleanly_and_keeps_other_entries(
    daemon_factory, tmp_path: Path, tmpfs: Callable[[str], Path]
) -> None:
    daemon = daemon_factory(cache_dir=tmpfs("6m") / "cache")
    small = write_tree(tmp_path / "small", n_files=10)
    # A download's size is unknown before it starts, so admission lets it in; the
    # 6 MiB disk fills part way through.
    behaviour = Behaviour(files={"/big.bin": bytes(16 * 2**20)})
    with serve_files(behaviour) as url, daemon.client() as client:
        kept = ready(client, copy_body("kept", small))
        response = client.post(
            "/v1/datasets",
            json={
                "name": "huge",
                "steps": [{"op": "fetch", "url": f"{url}/big.bin", "dst": "big.bin"}],
            },
        )
        assert response.status_code == 202, response.text
        status = client.get("/v1/datasets/huge/wait", params={"timeout": 60}).json()
        assert status["state"] == "failed"
        assert status["error"]["type"] == "io_error"
        assert "disk filled up" in status["error"]["message"]
        wait_until_empty(daemon.cache_dir / "partial")  # deleted in the background
        again = client.get("/v1/datasets/kept").json()
        assert again["state"] == "ready"
    assert digest(Path(kept["path"])) == digest(small)


def _sparse_tar(folder: Path) -> Path:
    """A tar of a few KiB (GNU tar -S) holding a 1 GiB file that is all hole but its
    first bytes: an image writes that hole out as zeros."""
    folder.mkdir()
    with open(folder / "huge.bin", "wb") as out:
        out.write(b"x" * 4096)
        out.truncate(1 << 30)
    archive = folder.parent / "sparse.tar"
    subprocess.run(["tar", "-S", "-cf", str(archive), "-C", str(folder), "huge.bin"], check=True)
    return archive


def _bomb_tar_gz(folder: Path, files: int, size: int) -> Path:
    """A .tar.gz of ``files`` files of ``size`` bytes of zeros (a few hundred KiB for
    200 MiB) whose gzip trailer says it holds one byte more than its own size: the
    estimate passes, the staging writes it all."""
    archive = folder.parent / f"bomb-{files}.tar.gz"
    with tarfile.open(archive, "w:gz", compresslevel=1) as tar:
        for number in range(files):
            member = tarfile.TarInfo(f"z{number:03d}")
            member.size = size
            tar.addfile(member, _Zeros(size))
    data = bytearray(archive.read_bytes())
    data[-4:] = (len(data) + 1).to_bytes(4, "little")
    archive.write_bytes(bytes(data))
    return archive


def _bomb_zip(folder: Path, size: int) -> Path:
    """A zip of a few hundred KiB holding one member of ``size`` bytes of zeros: its
    estimate is the archive's size (a zip's members are mostly stored)."""
    archive = folder / "bomb.zip"
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
        with zf.open("z000", "w", force_zip64=True) as member:
            for _ in range(size >> 20):
                member.write(bytes(1 << 20))
    return archive


class _Zeros(io.RawIOBase):
    """``size`` zero bytes, read without holding them."""

    def __init__(self, size: int) -> None:
        self.left = size

    def readinto(self, buffer) -> int:  # noqa: ANN001 - a writable buffer
        count = min(len(buffer), self.left)
        buffer[:count] = bytes(count)
        self.left -= count
        return count

    def readable(self) -> bool:
        return True


def test_a_source_that_makes_far_more_than_its_size_stops_at_the_disks_floor(
    daemon_factory, tmp_path: Path, tmpfs: Callable[[str], Path]
) -> None:
    """Admission lets a staging in by its estimate; a sparse member an image writes out,
    an archive whose trailer lies (its bytes in many files, or in one member far larger
    than the room), or a zip of one such member, then writes far more. The staging
    stops once it has written the room the disk had above its floor, shared data or
    not (no quota applies), not at a full disk, and what other entries hold stays."""
    disk = tmpfs("64m")
    daemon = daemon_factory(cache_dir=disk / "cache", env={"STAGER_MIN_FREE_BYTES": "32M"})
    small = write_tree(tmp_path / "small", n_files=10)
    sources = {
        "image": {"steps": [{"op": "extract", "src": str(_sparse_tar(tmp_path / "s"))}],
                  "image": True},
        # Many files: each counted once written; one: counted as its chunks land.
        "files": {"steps": [{"op": "extract", "src": str(_bomb_tar_gz(tmp_path, 200, 1 << 20))}]},
        "one": {"steps": [{"op": "extract", "src": str(_bomb_tar_gz(tmp_path, 1, 200 << 20))}]},
        "zip": {"steps": [{"op": "extract", "src": str(_bomb_zip(tmp_path, 200 << 20))}]},
    }  # fmt: skip
    with daemon.client() as client:
        kept = ready(client, copy_body("kept", small))
        for name, body in sources.items():
            response = client.post("/v1/datasets", json={"name": name, **body})
            assert response.status_code == 202, response.text
            status = client.get(f"/v1/datasets/{name}/wait", params={"timeout": 60}).json()
            assert status["state"] == "failed", status
            error = status["error"]
            assert error["type"] == "insufficient_space", error
            assert "all the room the cache's disk had above its floor" in error["message"]
            written = int(re.search(r"after writing (\d+) bytes", error["message"])[1])
            assert 8 << 20 < written < 48 << 20, error  # about the 32 MiB of room, not 64
            # Its attempt deleted before the next starts: a tree being deleted counts as
            # free room already, and the next case's room must be the disk's own.
            wait_until_empty(daemon.cache_dir / "partial")
        assert client.get("/v1/datasets/kept").json()["state"] == "ready"
    assert digest(Path(kept["path"])) == digest(small)


def test_stager_gc_command_evicts_every_unleased_dataset_with_all(
    daemon: Daemon, tmp_path: Path
) -> None:
    import sys

    with daemon.client() as client:
        kept = ready(
            client,
            copy_body("kept", write_tree(tmp_path / "a", n_files=3), lease={"holder": "job-1"}),
        )
        gone = ready(client, copy_body("gone", write_tree(tmp_path / "b", n_files=3, seed=5)))
    result = subprocess.run(
        [sys.executable, "-m", "stager", "gc", "--all"],
        env=daemon.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "evicted 1 dataset(s)" in result.stdout
    assert Path(kept["path"]).exists() and not Path(gone["path"]).exists()


def test_an_eviction_cut_short_never_leaves_a_ready_dataset_behind(
    daemon: Daemon, tmp_path: Path
) -> None:
    """A crash after the store says "evicted" but before the tree left ``data/``, and one
    while an evicted tree was being deleted: the restarted daemon reports the dataset
    evicted (never ready) and removes both leftovers; a new request stages afresh."""
    import sqlite3

    src = write_tree(tmp_path / "src", n_files=20)
    with daemon.client() as client:
        first = ready(client, copy_body("ds", src))
    daemon.stop()
    with sqlite3.connect(daemon.cache_dir / "state.db") as db:
        db.execute("UPDATE entries SET state = 'evicted' WHERE key = ?", (first["key"],))
    trash = daemon.cache_dir / "partial" / f"discarded-{'0' * 24}-deadbeef"
    write_tree(trash, n_files=5)  # a deletion a stop interrupted
    # Partial data of the same key that a failed cleanup left: the new staging below
    # must start from a fresh folder, not add to this one (or race its deletion).
    write_tree(daemon.cache_dir / "partial" / first["key"] / "stale", n_files=300, seed=9)
    daemon.start()
    with daemon.client() as client:
        assert client.get("/v1/datasets/ds").json()["state"] == "evicted"
        assert not Path(first["path"]).exists()  # out of data/ before the daemon answers
        wait_until_empty(daemon.cache_dir / "partial")  # deleted in the background
        response = client.post("/v1/datasets", json=copy_body("ds", src))
        assert response.status_code == 202, response.text
        again = client.get("/v1/datasets/ds/wait", params={"timeout": 60}).json()
        assert again["state"] == "ready" and digest(Path(again["path"])) == digest(src)


def test_an_evicted_tree_leaves_data_at_once_and_is_deleted_behind(
    daemon: Daemon, tmp_path: Path
) -> None:
    src = write_tree(tmp_path / "src", n_files=200)
    with daemon.client() as client:
        status = ready(client, copy_body("ds", src))
        assert client.delete("/v1/datasets/ds").json()["state"] == "evicted"
        assert not Path(status["path"]).exists()  # gone from data/ before the reply
        wait_until_empty(daemon.cache_dir / "partial")
        assert metric(client, "stager_evictions_total") == 1


def test_a_dangling_link_in_a_source_tree_is_copied_as_a_link(
    daemon: Daemon, tmp_path: Path
) -> None:
    """Fingerprinting a tree with a dangling link used to be a 500; like ``cp -r`` the
    copy keeps the link as it is."""
    src = write_tree(tmp_path / "src", n_files=5)
    (src / "broken").symlink_to(tmp_path / "nowhere")
    with daemon.client() as client:
        status = ready(client, copy_body("ds", src))
    assert os.readlink(Path(status["path"]) / "broken") == str(tmp_path / "nowhere")
