"""A process reads the TLS authorities once, for all its downloads, the checks of
their versions and the planner's sends (stager/core/downloads.py ``tls_context``: 20-50
ms each time), and the authority ``SSL_CERT_FILE`` names is the one they all trust: a
real HTTPS server whose certificate a private authority signed, reached with it and
refused without it."""

from __future__ import annotations

import asyncio
import hashlib
import os
import ssl
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from stager.core import downloads
from stager.core.errors import FetchFailed
from stager.core.settings import Settings
from stager.ops import fetch
from stager.ops.base import OpContext
from stager.ops.fetch import FetchStep
from stager.prestage.plan.service import Sender
from stager.wire.progress import Progress
from tests.httpserver import Behaviour, private_ca, serve_files

BODY = os.urandom(256 * 1024)
SHA = hashlib.sha256(BODY).hexdigest()


@pytest.fixture(scope="module")
def https(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A server of BODY over HTTPS, its certificate signed by an authority of the test's
    own: its base URL and that authority's certificate."""
    ca, tls = private_ca(tmp_path_factory.mktemp("ca"))
    with serve_files(Behaviour(files={"/data/a.bin": BODY}, etag='"v1"'), tls=tls) as url:
        yield url, ca


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str | None]]:
    """The authorities each TLS context made reads (the CA file), one entry a context;
    the process's context made afresh for the test, and again after it."""
    made: list[str | None] = []
    original = ssl.create_default_context

    def counted(*args: object, cafile: str | None = None, **kwargs: object) -> ssl.SSLContext:
        made.append(cafile)
        return original(*args, cafile=cafile, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ssl, "create_default_context", counted)
    monkeypatch.setattr(fetch, "BACKOFF_S", 0.01)
    downloads.tls_context.cache_clear()
    yield made
    downloads.tls_context.cache_clear()


def _fetch(url: str, root: Path, dst: str) -> bytes:
    root.mkdir(exist_ok=True)
    fetch.run(FetchStep(url=url, dst=dst, sha256=SHA), OpContext(root=root, progress=Progress()))
    return (root / dst).read_bytes()


def test_two_downloads_and_their_checks_read_the_authorities_once(
    https: tuple[str, Path],
    built: list[str | None],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    url, ca = https
    monkeypatch.setenv("SSL_CERT_FILE", str(ca))
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    assert _fetch(f"{url}/data/a.bin", tmp_path / "root", "a.bin") == BODY
    assert _fetch(f"{url}/data/a.bin", tmp_path / "root", "b.bin") == BODY
    size = len(BODY)
    for _ in range(2):  # a shared download's version, asked at every request
        assert downloads.validator(f"{url}/data/a.bin") == f'etag="v1";last-modified=;size={size}'
    assert built == [str(ca)]  # one context, of the authority SSL_CERT_FILE names


def test_without_the_authority_the_server_is_not_trusted(
    https: tuple[str, Path],
    built: list[str | None],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    url, _ = https
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    with pytest.raises(FetchFailed, match="CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
        _fetch(f"{url}/data/a.bin", tmp_path / "root", "a.bin")
    assert downloads.validator(f"{url}/data/a.bin") is None  # not shared: no version known
    assert len(built) == 1  # certifi's authorities, read once all the same


@pytest.mark.parametrize("trusted", [True, False], ids=["with-authority", "without"])
def test_the_planners_sends_share_the_context_and_its_authorities(
    https: tuple[str, Path],
    built: list[str | None],
    monkeypatch: pytest.MonkeyPatch,
    trusted: bool,
) -> None:
    """``stager plan``'s Sender made a TLS context of its own (httpx's default, which a
    client made with ``verify=True`` reads again): it takes the process's one, and
    trusts what it trusted (``SSL_CERT_FILE``, else certifi's)."""
    url, ca = https
    if trusted:
        monkeypatch.setenv("SSL_CERT_FILE", str(ca))
    else:
        monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)

    async def reach() -> list[bytes]:
        senders = [Sender(Settings()) for _ in range(2)]  # as two plan commands would
        try:
            return [(await s.client.get(f"{url}/data/a.bin")).content for s in senders]
        finally:
            for sender in senders:
                await sender.close()

    if trusted:
        assert asyncio.run(reach()) == [BODY, BODY]
        assert downloads.validator(f"{url}/data/a.bin") is not None  # a download's, too
    else:
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            asyncio.run(reach())
    assert len(built) == 1, built  # one context for all of them
    assert (built[0] == str(ca)) == trusted  # of SSL_CERT_FILE's authority, or certifi's
