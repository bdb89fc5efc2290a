"""Where the daemon is and how to talk to it: URL, Unix socket or TCP, bearer token.

The rules mirror ``stager.core.settings`` (socket ``${XDG_RUNTIME_DIR:-/tmp}/stager-$UID/
stager.sock``, token file ``<runtime_dir>/token``) without importing it: the daemon's
settings pull in pydantic-settings, and the client must stay light. They are kept
side by side on purpose; ``tests/client/test_discovery.py`` checks they agree.

Order: an explicit ``url`` > ``STAGER_URL`` > ``STAGER_SOCKET`` >
``$STAGER_RUNTIME_DIR/stager.sock`` > the default socket, unless the user has no
socket of their own there and the node service's does exist
(``/run/stager/stager.sock``, docs/multiuser.md). A token is sent on TCP only:
explicit > ``STAGER_TOKEN`` > ``STAGER_TOKEN_FILE`` > ``<runtime_dir>/token``.
"""

from __future__ import annotations

import functools
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from client.errors import BadConfiguration

# httpx needs a host in its URLs even when the bytes go over a Unix socket.
UDS_BASE_URL = "http://stager"


@functools.cache
def tls_context() -> ssl.SSLContext:
    """httpx's default TLS settings (certifi's authorities, or ``SSL_CERT_FILE`` /
    ``SSL_CERT_DIR``), read once a process (20-50 ms), not once a client."""
    return httpx.create_ssl_context()


@dataclass(frozen=True)
class Endpoint:
    """A resolved daemon address. ``url`` is what users see and put in STAGER_URL."""

    url: str
    base_url: str
    uds: str | None = None
    token: str | None = None

    def transport(self) -> httpx.HTTPTransport:
        return httpx.HTTPTransport(uds=self.uds, verify=self._verify())

    def async_transport(self) -> httpx.AsyncHTTPTransport:
        return httpx.AsyncHTTPTransport(uds=self.uds, verify=self._verify())

    def _verify(self) -> ssl.SSLContext | bool:
        # No TLS over a Unix socket; skipping the CA bundle load saves ~50 ms a process.
        return False if self.uds is not None else tls_context()

    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.token}"} if self.token else {}


def runtime_dir(env: Mapping[str, str]) -> Path:
    if env.get("STAGER_RUNTIME_DIR"):
        return Path(env["STAGER_RUNTIME_DIR"]).expanduser()
    base = env.get("XDG_RUNTIME_DIR") or "/tmp"
    return Path(base) / f"stager-{os.getuid()}"


# The node service's socket (stager serve --multi-user), as stager.core.settings says.
NODE_SOCKET = Path("/run/stager/stager.sock")


def default_socket(env: Mapping[str, str], node_socket: Path = NODE_SOCKET) -> Path:
    """The user's own daemon's socket; the node service's when the user has none and
    it is there. Named explicitly (STAGER_SOCKET, STAGER_RUNTIME_DIR), it is used as is."""
    if env.get("STAGER_SOCKET"):
        return Path(env["STAGER_SOCKET"]).expanduser()
    own = runtime_dir(env) / "stager.sock"
    if env.get("STAGER_RUNTIME_DIR") or own.exists() or not node_socket.exists():
        return own
    return node_socket


def discover(
    url: str | None = None, token: str | None = None, env: Mapping[str, str] | None = None
) -> Endpoint:
    """Resolve the daemon's endpoint from arguments, then the environment."""
    env = os.environ if env is None else env
    url = url or env.get("STAGER_URL") or f"unix://{default_socket(env)}"
    if url.startswith("/"):
        url = f"unix://{url}"  # a bare socket path is unambiguous; accept it
    parts = urlsplit(url)
    if parts.scheme == "unix":
        if not parts.path.startswith("/"):
            raise BadConfiguration(
                f"stager URL {url!r} must name an absolute socket path, as in "
                "unix:///run/user/1000/stager-1000/stager.sock"
            )
        return Endpoint(url=url, base_url=UDS_BASE_URL, uds=parts.path)
    if parts.scheme in ("http", "https") and parts.hostname:
        return Endpoint(url=url, base_url=url.rstrip("/"), token=token or _token(env))
    raise BadConfiguration(
        f"stager URL {url!r} is not understood; use unix:///path/to/stager.sock "
        "or http://host:port (set by --url or STAGER_URL)"
    )


def _token(env: Mapping[str, str]) -> str | None:
    if env.get("STAGER_TOKEN"):
        return env["STAGER_TOKEN"]
    explicit = env.get("STAGER_TOKEN_FILE")
    path = Path(explicit).expanduser() if explicit else runtime_dir(env) / "token"
    try:
        return path.read_text().strip() or None
    except FileNotFoundError:
        if explicit:
            raise BadConfiguration(
                f"token file {path} (STAGER_TOKEN_FILE) does not exist; point it at the "
                "daemon's token file or set STAGER_TOKEN"
            ) from None
        return None  # a daemon started with --no-token needs none
    except PermissionError as exc:
        raise BadConfiguration(
            f"token file {path} cannot be read ({exc.strerror}); it belongs to the user "
            "who started the daemon"
        ) from exc
