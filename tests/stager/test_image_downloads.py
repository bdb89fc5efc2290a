"""An image dataset of a URL is built as the archive downloads (stager.kinds.imaging, through
stager.staging.overlap.follow_download): the image is being written while the server is still
sending, the mounted image holds exactly what GNU tar extracts, a dropped connection
and a kill -9 mid-download end in the same image, and bytes that fail their sha256 are
never published or mounted.

Archives are written by GNU tar and served by a real HTTP server; a real daemon."""

from __future__ import annotations

import hashlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from stager.image import mount as image_mount
from tests.daemon import Daemon, stage, stage_ready, unmount_under
from tests.stager.test_overlap import (
    corpus,
    first_sight,
    http,
    serve,
    serve_slow_archive,
    server,
    snapshot,
)

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="kernel mounts need root"),
    pytest.mark.forked_daemons,  # tests/daemon_zygote.py
]
__all__ = ["corpus", "http", "server"]  # the fixtures, shared with test_overlap

TIMEOUT = 60


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """One daemon for the tests that stage under a name of their own and look at
    nothing else it holds (a start is 1.5-4 s of a CI worker); a test that kills its
    daemon or reads its whole cache makes its own (``daemon_factory``)."""
    shared = Daemon(cache_dir=tmp_path_factory.mktemp("image-downloads") / "cache")
    try:
        yield shared.start()
    finally:
        shared.cleanup()


@pytest.fixture(autouse=True)
def unmounts(tmp_path: Path):  # noqa: ANN201
    """Whatever a killed daemon leaves mounted under the test's folder is taken down."""
    yield
    unmount_under(tmp_path)


def url_image(url: str, name: str = "u", **fetch: object) -> dict:
    """An image dataset of the extract of ``url`` (run as a fetch and an extract)."""
    return {"name": name, "steps": [{"op": "extract", "src": url, **fetch}], "image": True}


def building(daemon: Daemon) -> int:
    """Bytes of the image being built in any attempt's folder now (0: none)."""
    sizes = [p.stat().st_size for p in (daemon.cache_dir / "partial").glob("*/*.partial")]
    return max(sizes, default=0)


def assert_mounted_image(path: str, reference: dict) -> None:
    found = image_mount.mounted_at(path)
    assert found is not None and found.fstype == "erofs"
    assert snapshot(Path(path), skip="") == reference


@pytest.mark.parametrize("name", ["data.tar", "data.tar.gz", "data.tar.zst"])
def test_an_image_of_a_url_holds_exactly_what_gnu_tar_extracts(
    name: str, daemon: Daemon, corpus, http
) -> None:
    behaviour, url, data, built = serve(corpus, http, name)
    sha = hashlib.sha256(data).hexdigest()
    with daemon.client() as client:
        status = stage_ready(client, url_image(f"{url}/pub/{name}", name, sha256=sha), TIMEOUT)
        assert_mounted_image(status.path, built["references"][name])
        assert status.progress.bytes_done == status.progress.bytes_total == 2 * len(data)
        # Nothing of the download is left beside the image.
        assert status.image is not None
        assert sorted(os.listdir(Path(status.image.file).parent)) == ["dataset", "dataset.erofs"]
    assert behaviour.requests == 1  # one GET: the archive is read once


def test_the_image_is_built_while_the_archive_still_downloads(
    daemon: Daemon, http, tmp_path: Path
) -> None:
    behaviour, url = http
    source, data = serve_slow_archive(behaviour, tmp_path)
    with first_sight(behaviour, lambda: building(daemon) > 1 << 20) as sent:
        with daemon.client() as client:
            status = stage_ready(client, url_image(f"{url}/pub/slow.tar.gz", "slow"), TIMEOUT)
    assert sent, "no image was written while the archive downloaded"
    assert sent[0] < 0.75 * len(data), (
        f"the image grew past 1 MiB only after {sent[0]} of {len(data)} bytes were sent"
    )
    mounted = Path(status.path) / source.name
    assert (mounted / "part_7.bin").read_bytes() == (source / "part_7.bin").read_bytes()


def test_a_dropped_connection_resumes_and_gives_the_same_image(
    daemon: Daemon, corpus, http
) -> None:
    behaviour, url, data, built = serve(corpus, http, "data.tar.gz")
    behaviour.drop_after = len(data) // 2
    behaviour.bytes_per_s = 20e6  # so the build is waiting when the connection drops
    with daemon.client() as client:
        body = url_image(f"{url}/pub/data.tar.gz", "dropped")
        status = stage_ready(client, body, TIMEOUT)
        assert_mounted_image(status.path, built["references"]["data.tar.gz"])
    assert [r for r in behaviour.ranges_seen if r != "bytes=0-"], "the download started over"


def test_a_wrong_sha256_never_publishes_the_image_built_from_its_bytes(
    daemon_factory, corpus, http
) -> None:
    """The whole image is built from the download before its sha256 is known: it must
    not take its name, be published or mounted."""
    daemon = daemon_factory()  # its whole data/ is looked at
    _, url, _, _ = serve(corpus, http, "data.tar.gz")
    with daemon.client() as client:
        body = url_image(f"{url}/pub/data.tar.gz", "bad", sha256="0" * 64)
        assert stage(client, body).status_code == 202
        status = client.get("/v1/datasets/bad/wait", params={"timeout": TIMEOUT}).json()
    assert status["state"] == "failed"
    assert status["error"]["type"] == "verify_failed", status["error"]
    data_dir = daemon.cache_dir / "data"
    assert not data_dir.exists() or not any(data_dir.iterdir())
    assert not list((daemon.cache_dir / "partial").rglob("image.erofs*"))
    assert image_mount.mounted_at(str(data_dir / status["key"])) is None


def test_kill_9_mid_download_builds_the_image_again_after_restart(
    daemon_factory, corpus, http
) -> None:
    """The daemon (and its staging process) killed while the archive is half downloaded
    and the image half built: the restarted daemon resumes the download with a Range
    request, builds again from the first byte, and mounts exactly GNU tar's tree."""
    daemon = daemon_factory()  # killed
    behaviour, url, data, built = serve(corpus, http, "data.tar.gz")
    behaviour.bytes_per_s = 2e6
    sha = hashlib.sha256(data).hexdigest()
    with daemon.client() as client:
        assert (
            stage(client, url_image(f"{url}/pub/data.tar.gz", "mid", sha256=sha)).status_code == 202
        )
        deadline = time.monotonic() + 20
        while not building(daemon):
            assert time.monotonic() < deadline, "the build never started mid-download"
            time.sleep(0.02)
    assert behaviour.sent < len(data), "the download ended before the kill"
    daemon.kill()
    behaviour.bytes_per_s = None
    daemon.start()
    with daemon.client() as client:
        waited = client.get("/v1/datasets/mid/wait", params={"timeout": TIMEOUT}).json()
    assert waited["state"] == "ready", waited["error"]
    assert_mounted_image(waited["path"], built["references"]["data.tar.gz"])
    assert [r for r in behaviour.ranges_seen if r != "bytes=0-"], "the download started over"


def test_a_crash_right_after_the_image_is_named_never_serves_bytes_that_fail_their_sha256(
    daemon_factory, corpus, http, tmp_path: Path
) -> None:
    """The image takes its name (``image-built``, which a restart trusts) only after the
    download's sha256 passed: with a wrong one, a daemon told to die at that step never
    reaches it, and the dataset ends failed, never ready, after a restart as before.
    The tar's end comes 2 MiB before the file's (zero blocks, which GNU tar ignores):
    the build must still wait for the download's end and its check, not publish what
    it read once the tar's end marker came."""
    behaviour, url, data, _ = serve(corpus, http, "data.tar")
    behaviour.files = {"/pub/data.tar": data + bytes(2 << 20)}
    behaviour.bytes_per_s = 8e6
    cache = tmp_path / "cache"
    crashing = daemon_factory(env={"STAGER_CRASH_AFTER": "image-built#1@1"}, cache_dir=cache)
    body = url_image(f"{url}/pub/data.tar", "bad", sha256="0" * 64)
    with crashing.client() as client:
        assert stage(client, body).status_code == 202
        try:
            client.get("/v1/datasets/bad/wait", params={"timeout": TIMEOUT})
        except httpx.TransportError:
            pass  # it died at the step: what a restart finds decides
    crashing.stop(signal.SIGKILL)
    again = daemon_factory(cache_dir=cache)
    with again.client() as client:
        status = client.get("/v1/datasets/bad/wait", params={"timeout": TIMEOUT}).json()
    assert status["state"] == "failed", status
    assert image_mount.mounted_at(str(cache / "data" / status["key"])) is None
