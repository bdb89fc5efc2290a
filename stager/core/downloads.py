"""When the node service may share a download between users, and how a shared one
stays true to its URL.

A download is shared (one entry for everyone who asks for the URL) only when:

- its URL carries none of the user's credentials (``fetch.without_credentials``);
- its URL does not name this node (:func:`names_this_node`): a server on a local
  address may be any user's, who could plant their bytes under that URL for everyone
  (the download checks the address it actually reached too);
- and its sha256 is pinned, or the server names the version it sends (``ETag`` or
  ``Last-Modified``, asked with a ``HEAD`` at every request), which is part of the
  cache key: a changed file is a miss.

Everything here runs as the asking user (the request's checks), never as root.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import socket
import ssl
from typing import Any

import httpx

REVALIDATE_TIMEOUT = httpx.Timeout(10.0, connect=5.0)


def names_this_node(host: str) -> bool:
    """Whether ``host`` is, or resolves to, an address of this node: loopback, or one
    bound to one of its interfaces (a socket can bind to it). A name that does not
    resolve is not this node (the download will fail on its own)."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return False
    return any(is_this_node(info[4][0]) for info in infos)


def is_this_node(address: str) -> bool:
    """Whether the IP ``address`` is loopback, unspecified, or bound on this node."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    if ip.is_loopback or ip.is_unspecified:
        return True
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((address, 0))
        except OSError:
            return False  # EADDRNOTAVAIL: not one of ours
    return True


@functools.cache
def tls_context() -> ssl.SSLContext:
    """The TLS settings of every download and every check of one, as httpx makes them
    by default (certifi's authorities, or ``SSL_CERT_FILE`` / ``SSL_CERT_DIR``), made
    once a process: reading the authorities takes 20-50 ms, which a client made with
    ``verify=True`` pays again each time."""
    return httpx.create_ssl_context()


def _client() -> httpx.Client:
    # The download's own authorities: a server the download may reach, the check reaches
    # too. trust_env=False still keeps the environment's proxies and .netrc out.
    return httpx.Client(
        verify=tls_context(), follow_redirects=True, timeout=REVALIDATE_TIMEOUT, trust_env=False
    )


def warm_up() -> None:
    """Load now what a first client loads (TLS authorities, the transport): the user
    processes that revalidate are forked after this (stager.engine.preload) and may not be
    able to read the interpreter's files themselves."""
    _client().close()
    "localhost".encode("idna")


def validator(url: str) -> str | None:
    """What identifies the version of the file at ``url`` now, from the server's
    ``ETag`` (strong) or ``Last-Modified``, with its length: a ``HEAD``, or a one-byte
    ``GET`` for a server that refuses ``HEAD``. None when the server names no version,
    or cannot be reached: such a download is not shared."""
    with contextlib.suppress(httpx.HTTPError, OSError):
        with _client() as c:
            response = c.head(url, headers={"Accept-Encoding": "identity"})
            if response.status_code in (405, 501):
                response = c.get(url, headers={"Range": "bytes=0-0", "Accept-Encoding": "identity"})
            if response.status_code >= 400:
                return None
            return _version(response.headers)
    return None


def _version(headers: Any) -> str | None:
    etag = headers.get("etag") or ""
    strong = etag if etag and not etag.startswith("W/") else ""
    modified = headers.get("last-modified") or ""
    if not strong and not modified:
        return None
    size = headers.get("content-length") or ""
    if headers.get("content-range"):
        size = headers["content-range"].rpartition("/")[2]
    return f"etag={strong};last-modified={modified};size={size}"
