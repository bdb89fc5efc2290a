from __future__ import annotations

import functools
import hashlib
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from stager.core.errors import Cancelled, FetchFailed, VerifyFailed
from stager.ops import fetch
from stager.ops.base import CheckContext, OpContext
from stager.ops.fetch import FetchStep
from stager.wire.progress import Progress
from tests.httpserver import Behaviour, serve_files
from tests.imports import REPO

BODY = os.urandom(1024 * 1024 + 123)
SHA = hashlib.sha256(BODY).hexdigest()


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fetch, "BACKOFF_S", 0.01)


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[Behaviour, str]]:
    # One server for the module: stopping one costs half a second of polling.
    behaviour = Behaviour()
    with serve_files(behaviour) as url:
        yield behaviour, url


@pytest.fixture
def behaviour(server: tuple[Behaviour, str]) -> Behaviour:
    """The module's server, reset to serve BODY with no faults and no history."""
    return server[0].reset({"/data/train.tar": BODY})


@pytest.fixture
def base_url(server: tuple[Behaviour, str], behaviour: Behaviour) -> str:
    return server[1]


@pytest.fixture
def ctx(tmp_path: Path) -> OpContext:
    root = tmp_path / "root"
    root.mkdir()
    return OpContext(root=root, progress=Progress())


def step(url: str, dst: str = "train.tar", sha256: str | None = SHA) -> FetchStep:
    return FetchStep(url=url, dst=dst, sha256=sha256)


def test_download_with_checksum(base_url: str, ctx: OpContext) -> None:
    fetch.run(step(f"{base_url}/data/train.tar", dst="."), ctx)
    assert (ctx.root / "train.tar").read_bytes() == BODY
    assert not (ctx.root / "train.tar.part").exists()
    snap = ctx.progress.snapshot()
    assert snap.bytes_done == snap.bytes_total == len(BODY)
    assert snap.files_done == snap.files_total == 1


def test_cut_connection_resumes_with_range(
    base_url: str, behaviour: Behaviour, ctx: OpContext
) -> None:
    behaviour.drop_after = 300_000
    fetch.run(step(f"{base_url}/data/train.tar"), ctx)
    assert len(behaviour.ranges_seen) == 1
    resumed_at = int(behaviour.ranges_seen[0].removeprefix("bytes=").rstrip("-"))
    assert 0 < resumed_at < len(BODY)
    assert hashlib.sha256((ctx.root / "train.tar").read_bytes()).hexdigest() == SHA
    assert ctx.progress.bytes_done == len(BODY)  # retries never double-count


def test_restart_resumes_from_the_part_file(
    base_url: str, behaviour: Behaviour, ctx: OpContext
) -> None:
    (ctx.root / "train.tar.part").write_bytes(BODY[:500_000])
    fetch.run(step(f"{base_url}/data/train.tar"), ctx)
    assert behaviour.ranges_seen == ["bytes=500000-"]
    assert (ctx.root / "train.tar").read_bytes() == BODY


def test_complete_part_file_is_finished_on_416(
    base_url: str, behaviour: Behaviour, ctx: OpContext
) -> None:
    (ctx.root / "train.tar.part").write_bytes(BODY)
    fetch.run(step(f"{base_url}/data/train.tar"), ctx)
    assert (ctx.root / "train.tar").read_bytes() == BODY
    assert behaviour.requests == 1


def test_stale_longer_part_file_starts_over(
    base_url: str, behaviour: Behaviour, ctx: OpContext
) -> None:
    (ctx.root / "train.tar.part").write_bytes(BODY + b"stale tail")
    fetch.run(step(f"{base_url}/data/train.tar"), ctx)
    assert (ctx.root / "train.tar").read_bytes() == BODY


def test_finished_file_is_not_downloaded_again(
    base_url: str, behaviour: Behaviour, ctx: OpContext
) -> None:
    fetch.run(step(f"{base_url}/data/train.tar"), ctx)
    fetch.run(step(f"{base_url}/data/train.tar"), ctx)
    assert behaviour.requests == 1


def test_wrong_sha256_fails_naming_url_and_hashes(base_url: str, ctx: OpContext) -> None:
    url = f"{base_url}/data/train.tar"
    with pytest.raises(VerifyFailed) as info:
        fetch.run(step(url, sha256="0" * 64), ctx)
    message = info.value.message
    assert url in message and SHA in message and "0" * 64 in message
    assert not (ctx.root / "train.tar").exists()
    assert not (ctx.root / "train.tar.part").exists()


def test_404_fails_with_status_and_url(base_url: str, behaviour: Behaviour, ctx: OpContext) -> None:
    url = f"{base_url}/data/missing.tar"
    with pytest.raises(FetchFailed, match="404") as info:
        fetch.run(step(url), ctx)
    assert url in info.value.message
    assert behaviour.requests == 1  # a 404 is final, not retried


def test_unreachable_server_fails_after_bounded_retries(ctx: OpContext) -> None:
    with socket.socket() as sock:  # a port that was free a moment ago: connection refused
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}/x.tar"
    with pytest.raises(FetchFailed, match=f"{fetch.MAX_ATTEMPTS} attempts") as info:
        fetch.run(step(url, dst="x.tar"), ctx)
    assert url in info.value.message


def test_server_without_range_support_restarts_cleanly(tmp_path: Path, ctx: OpContext) -> None:
    # http.server's own file handler ignores Range and answers 200 with the whole file.
    served = tmp_path / "www"
    served.mkdir()
    (served / "train.tar").write_bytes(BODY)
    (ctx.root / "train.tar.part").write_bytes(b"garbage from an older run")
    handler = functools.partial(_QuietFiles, directory=str(served))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        fetch.run(step(f"http://127.0.0.1:{server.server_address[1]}/train.tar"), ctx)
    finally:
        server.shutdown()
        server.server_close()
    assert (ctx.root / "train.tar").read_bytes() == BODY


def test_cancel_before_download(base_url: str, ctx: OpContext) -> None:
    ctx.cancel.set()
    with pytest.raises(Cancelled):
        fetch.run(step(f"{base_url}/data/train.tar"), ctx)


def test_check_does_no_network_io_and_estimates_zero() -> None:
    assert fetch.check(step("http://127.0.0.1:9/never/contacted.tar", dst="."), CheckContext()) == 0


class _QuietFiles(SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize(
    ("url", "public"),
    [
        ("http://h/data.tar", True),
        ("https://h:8443/a/b%20c.tar", True),
        ("http://h/data.tar#part?x", True),  # a fragment is never sent
        ("http://h/p%3Fx", True),  # an escaped '?' is part of the path
        ("http://u:p@h/data.tar", False),
        ("http://u@h/data.tar", False),
        ("http://:@h/data.tar", False),  # an empty Authorization header still goes out
        ("http://u%40x:p@h/data.tar", False),
        ("http://h/data.tar?token=abc", False),
        ("http://h/data.tar?", False),
        ("http://h/data.tar;jsessionid=SECRET", False),
    ],
)
def test_a_download_is_public_only_when_its_url_carries_nothing_of_the_user(
    url: str, public: bool
) -> None:
    assert fetch.without_credentials(fetch.FetchStep(url=url, dst="d")) is public


def test_the_fork_server_pays_a_downloads_set_up_before_any_staging_starts(
    base_url: str, tmp_path: Path
) -> None:
    """What a process's first download pays before its first byte (its TLS authorities
    loaded, httpx's transport imported, the codec that host names are looked up with:
    20-70 ms) the staging processes' fork server has paid when it imported its preload
    (stager.engine.preload): a staging's download then loads nothing more."""
    code = f"""
import sys
from pathlib import Path
import stager.engine.preload
from stager.ops import fetch
from stager.ops.base import OpContext
from stager.wire.progress import Progress

before = set(sys.modules)
ctx = OpContext(root=Path({str(tmp_path)!r}), progress=Progress())
fetch.run(fetch.FetchStep(url={base_url + "/data/train.tar"!r}, dst="train.tar"), ctx)
assert (ctx.root / "train.tar").stat().st_size == {len(BODY)}
print(sorted(set(sys.modules) - before))
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
