"""Crash, shutdown and cancel in the middle of a multi-file staging.

A throttled local HTTP server makes one step slow, so the test can act while the
dataset is provably half-staged: files of the first step are in the partial
directory, the fetch is under way, the last step has not run.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import time
from pathlib import Path

import httpx
import pytest

from stager.wire.schemas import DatasetPublic
from tests.daemon import Daemon
from tests.httpserver import Behaviour, serve_files
from tests.stager.test_cache import metric
from tests.trees import digest, make_tar, wait_until_empty, write_tree

pytestmark = pytest.mark.forked_daemons  # its daemons: tests/daemon_zygote.py

BLOB = bytes(range(256)) * 8192  # 2 MiB


def request(tmp_path: Path, base_url: str) -> dict:
    first = write_tree(tmp_path / "first", n_files=150, seed=1)
    last = write_tree(tmp_path / "last", n_files=20, seed=2)
    archive = make_tar(write_tree(tmp_path / "train", n_files=20, seed=3), tmp_path / "t.tar.gz")
    return {
        "name": "multi",
        "steps": [
            {"op": "copy", "src": str(first), "dst": "first"},
            # Re-running these two after a crash would fail: the rename must not run twice.
            {"op": "extract", "src": str(archive)},
            {"op": "rename", "src": "train", "dst": "2021_train"},
            {
                "op": "fetch",
                "url": f"{base_url}/blob.bin",
                "dst": "blob.bin",
                "sha256": hashlib.sha256(BLOB).hexdigest(),
            },
            {"op": "copy", "src": str(last), "dst": "last"},
        ],
    }


def expected_digest(tmp_path: Path) -> dict[str, str]:
    out = {f"first/{k}": v for k, v in digest(tmp_path / "first").items()}
    out.update({f"last/{k}": v for k, v in digest(tmp_path / "last").items()})
    out.update({f"2021_train/{k}": v for k, v in digest(tmp_path / "train").items()})
    out["blob.bin"] = hashlib.sha256(BLOB).hexdigest()
    return out


class ReadyWatcher(threading.Thread):
    """Polls status the whole time; records any moment "ready" was shown with wrong content."""

    def __init__(self, daemon: Daemon, expected: dict[str, str]) -> None:
        super().__init__(daemon=True)
        self.daemon_under_test, self.expected = daemon, expected
        self.violations: list[str] = []
        self.states: list[str] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            try:
                with self.daemon_under_test.client(timeout=2) as client:
                    status = DatasetPublic.model_validate_json(
                        client.get("/v1/datasets/multi").text
                    )
            except (httpx.TransportError, ValueError):
                time.sleep(0.02)  # daemon down between kill and restart
                continue
            self.states.append(status.state)
            final = Path(status.path)
            if status.state == "ready" and digest(final) != self.expected:
                self.violations.append("reported ready with incomplete content")
            # The final path may appear a moment before the status says ready (publish is
            # the commit point), but it must never hold a partial tree.
            if final.exists() and digest(final) != self.expected:
                self.violations.append(f"partial content at the final path while {status.state}")
            time.sleep(0.02)


def part_bytes(partial: Path) -> int:
    """Bytes in the .part files under ``partial``, read while the staging changes the
    tree (earlier steps rename folders), so vanished entries are skipped."""
    total = 0
    for folder, _, files in os.walk(partial):
        for name in files:
            if name.endswith(".part"):
                with contextlib.suppress(FileNotFoundError):
                    total += os.stat(os.path.join(folder, name)).st_size
    return total


def wait_until_fetching(daemon: Daemon) -> None:
    """Return once the download is under way: the first step done, a .part file growing."""
    deadline = time.monotonic() + 20
    partial = daemon.cache_dir / "partial"
    with daemon.client() as client:
        while time.monotonic() < deadline:
            progress = client.get("/v1/datasets/multi").json()["progress"]
            if progress["step"] == "fetch" and part_bytes(partial) > 100_000:
                return
            time.sleep(0.02)
    raise AssertionError("staging never reached the middle of the fetch step")


@pytest.mark.parametrize("how", ["kill -9", "SIGTERM"])
def test_interrupted_staging_resumes_and_is_never_ready_while_partial(
    daemon: Daemon, tmp_path: Path, how: str
) -> None:
    behaviour = Behaviour(files={"/blob.bin": BLOB}, bytes_per_s=1_000_000)
    with serve_files(behaviour) as url:
        body = request(tmp_path, url)
        expected = expected_digest(tmp_path)
        watcher = ReadyWatcher(daemon, expected)
        watcher.start()
        with daemon.client() as client:
            assert client.post("/v1/datasets", json=body).status_code == 202
        wait_until_fetching(daemon)
        partial = daemon.cache_dir / "partial"
        assert any(partial.rglob("*.jpg")), "first step's files should be in the partial dir"

        t0 = time.monotonic()
        if how == "kill -9":
            daemon.kill()
        else:
            assert daemon.stop() == 0  # graceful: exit code 0 ...
            assert time.monotonic() - t0 < 8  # ... within a few seconds
        behaviour.bytes_per_s = None
        daemon.start()
        with daemon.client() as client:
            status = DatasetPublic.model_validate_json(
                client.get("/v1/datasets/multi/wait", params={"timeout": 60}).text
            )
        watcher.done.set()
        watcher.join()

    assert status.state == "ready", status.error
    assert digest(Path(status.path)) == expected
    assert watcher.violations == []
    assert "staging" in watcher.states
    # The fetch resumed from its .part file instead of starting over.
    assert behaviour.ranges_seen, "the resumed fetch should send a Range request"
    assert list(partial.iterdir()) == []


def test_interrupted_download_resumes_with_range_and_checks_sha256(
    daemon: Daemon, tmp_path: Path
) -> None:
    behaviour = Behaviour(files={"/data.bin": BLOB}, drop_after=700_000)
    good = hashlib.sha256(BLOB).hexdigest()
    with serve_files(behaviour) as url, daemon.client() as client:
        body = {
            "name": "dl",
            "steps": [{"op": "fetch", "url": f"{url}/data.bin", "dst": "data.bin", "sha256": good}],
        }
        client.post("/v1/datasets", json=body)
        status = client.get("/v1/datasets/dl/wait", params={"timeout": 30}).json()
    assert status["state"] == "ready", status["error"]
    assert behaviour.ranges_seen and behaviour.ranges_seen[0].startswith("bytes=")
    assert hashlib.sha256((Path(status["path"]) / "data.bin").read_bytes()).hexdigest() == good


def test_cancel_during_staging_removes_partial_data(daemon: Daemon, tmp_path: Path) -> None:
    behaviour = Behaviour(files={"/blob.bin": BLOB}, bytes_per_s=500_000)
    with serve_files(behaviour) as url, daemon.client() as client:
        client.post("/v1/datasets", json=request(tmp_path, url))
        wait_until_fetching(daemon)
        cancelled = client.delete("/v1/datasets/multi").json()
        assert cancelled["state"] == "cancelled"
        assert "cancelled" in cancelled["error"]["message"]
    wait_until_empty(daemon.cache_dir / "partial")  # deleted in the background
    assert not Path(cancelled["path"]).exists()


def test_sigterm_answers_open_long_polls_and_exits_promptly(daemon: Daemon, tmp_path: Path) -> None:
    import threading

    behaviour = Behaviour(files={"/blob.bin": BLOB}, bytes_per_s=200_000)
    answers: list[int] = []
    with serve_files(behaviour) as url:
        with daemon.client() as client:
            client.post("/v1/datasets", json=request(tmp_path, url))

        def long_poll() -> None:
            with daemon.client() as client:
                answers.append(
                    client.get("/v1/datasets/multi/wait", params={"timeout": 60}).status_code
                )

        poller = threading.Thread(target=long_poll)
        poller.start()
        with daemon.client() as client:  # until the long poll is inside the daemon
            deadline = time.monotonic() + 30
            while metric(client, "stager_waiting_requests") != 1:
                assert time.monotonic() < deadline, "the long poll never reached the daemon"
                time.sleep(0.02)
        t0 = time.monotonic()
        assert daemon.stop() == 0
        elapsed = time.monotonic() - t0
        poller.join(10)
    assert answers == [200]  # the current status, not a 500 after a timeout
    assert elapsed < 4
