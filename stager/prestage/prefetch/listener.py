"""The node service's TCP port for the planner (``prefetch_listen``): a small ASGI app on
the daemon's loop, not the API on TCP, handing to the app's own :class:`Prefetches`
``POST /v1/prefetches`` (an order) and ``GET /v1/copies`` (another planned node's copy
of this node's prefetch, proven by the asking service's own credential first, then the
planner's copy credential). A call without a credential is 401 before its body is
read; a body over :data:`ORDER_MAX_BYTES` or of no stated length 413/411, unread; one
slower than ``header_timeout_s`` 408; anything else 404 with one fixed sentence. Every
answer closes its connection; connections are capped (:data:`MAX_CONNECTIONS`), and
shared between source addresses (:mod:`stager.api.prefetch_port`). The threats
it answers: docs/prestaging.md, "Threats on the port".
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
from collections.abc import Coroutine
from typing import Any

from starlette.datastructures import Headers
from starlette.types import Receive, Scope, Send

from stager.core.errors import StagerError, error_content
from stager.core.settings import PRIVILEGED_BELOW, Settings, host_port
from stager.ops import copy_from_node as copying
from stager.prestage.prefetch.authority import (
    ASKER_HEADER,
    COPY_HEADER,
    NotAuthorized,
    credential_of,
)
from stager.staging.blocking import run_io

log = logging.getLogger("stager.prestage.prefetch")

ROUTE = "/v1/prefetches"
COPIES = "/v1/copies"  # another planned node's copy of a prefetch (stager.ops.copy_from_node)
SEND_CHUNK = 1 << 20
# An order is one declared dataset's stage body: job_submit.lua keeps a declaration to
# 4 KiB, so 64 KiB is far above any genuine order and bounds what a stranger makes us hold.
ORDER_MAX_BYTES = 64 * 1024
# The planner's sends to one node are a handful at once (32 at most); strangers get no
# more, and the places go first to the connections that send their request whole.
MAX_CONNECTIONS = 64
UNPRIVILEGED_START = "/proc/sys/net/ipv4/ip_unprivileged_port_start"
NOT_HERE = (
    "this port takes the planner's prefetch orders only (POST /v1/prefetches, and "
    "GET /v1/copies with a copy's credential)"
)


class ListenError(Exception):
    """Why the listener cannot start, as one sentence."""


def bind(settings: Settings) -> socket.socket:
    """The listening socket for ``prefetch_listen``, bound now: a taken or foreign
    address stops the service's start with a sentence, before anything else starts."""
    text = settings.prefetch_listen or ""
    host, port = host_port(text)
    fix = "give STAGER_PREFETCH_LISTEN (--prefetch-listen) an address of this node and a free port"
    lowest = _unprivileged_start()
    if port >= lowest:  # (the setting holds it below 1024; the kernel may allow users lower)
        raise ListenError(
            f"--prefetch-listen {text}: users may bind port {port} on this node "
            f"({UNPRIVILEGED_START} is {lowest}), so one could listen there while this "
            "service is down and be sent the planner's orders; set the sysctl "
            "net.ipv4.ip_unprivileged_port_start back to 1024"
        )
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise ListenError(
            f"--prefetch-listen {text}: {host} is not an address ({exc.strerror}); {fix}"
        ) from exc
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(MAX_CONNECTIONS)
    except OSError as exc:
        sock.close()
        raise ListenError(
            f"--prefetch-listen {text}: cannot listen there ({exc.strerror}); {fix}"
        ) from exc
    sock.setblocking(False)
    return sock


def _unprivileged_start() -> int:
    """The lowest port a user may bind here (Linux; 1024 unless an admin lowered it)."""
    try:
        with open(UNPRIVILEGED_START) as file:
            return int(file.read())
    except (OSError, ValueError):
        return PRIVILEGED_BELOW


class Orders:
    """The port's ASGI app."""

    def __init__(self, prefetches: Any) -> None:
        self.prefetches = prefetches  # stager.prestage.prefetch.service.Prefetches

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        route = (scope["method"], scope["path"])
        if route not in (("POST", ROUTE), ("GET", COPIES)):
            await _answer(send, 404, error_content("not_found", NOT_HERE))
            return
        headers = Headers(scope=scope)
        header = headers.get("authorization")
        try:
            credential_of(header)
        except NotAuthorized as exc:
            await _answer(send, exc.status, error_content(exc.type, exc.message))
            return
        length = headers.get("content-length", "")
        if not length.isdigit():
            sentence = "an order states its length (Content-Length)"
            await _answer(send, 411, error_content("length_required", sentence))
            return
        if int(length) > ORDER_MAX_BYTES:
            sentence = f"an order is at most {ORDER_MAX_BYTES} bytes; this one says {length}"
            await _answer(send, 413, error_content("body_too_large", sentence))
            return
        deadline = self.prefetches.settings.header_timeout_s
        try:  # within the head's own time: a slow body must not hold a place
            body = await asyncio.wait_for(_body(receive), deadline)
        except _Gone:  # (its place went to another address's connection: stager.api.prefetch_port)
            return
        except TimeoutError:
            sentence = f"the body did not arrive within {deadline:g} s (STAGER_HEADER_TIMEOUT_S)"
            await _answer(send, 408, error_content("body_timeout", sentence))
            return
        if route == ("GET", COPIES):
            copy = self._copy(send, header, body, headers.get(ASKER_HEADER))
            await _while_connected(receive, copy)
            return
        try:
            done = await self.prefetches.order(header, body, headers.get(COPY_HEADER))
        except StagerError as exc:
            await _answer(send, exc.status, error_content(exc.type, exc.message))
            return
        await _answer(send, 200, {"data": done, "count": len(done)})

    async def _copy(self, send: Send, header: str | None, body: bytes, asker: str | None) -> None:
        try:
            outgoing = await self.prefetches.copy_out(header, body, asker)
        except StagerError as exc:
            await _answer(send, exc.status, error_content(exc.type, exc.message))
            return
        deadline = self.prefetches.settings.prefetch_copy_send_timeout_s
        try:
            await _stream(send, outgoing, deadline)
        except TimeoutError:  # the connection closes as the app returns unanswered
            log.warning("a copy's receiver took nothing for %g s; cut off", deadline)
        finally:  # (shielded: the disconnect that follows a full answer may cancel us)
            await asyncio.shield(outgoing.done())


async def _while_connected(receive: Receive, work: Coroutine[Any, Any, None]) -> None:
    """``work``, cancelled if the client leaves first, so no copy is made for nobody."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        gone.cancel()
        await asyncio.gather(task, gone, return_exceptions=True)
    if not task.cancelled() and task.exception() is not None:
        raise task.exception()  # type: ignore[misc]


async def _disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class _Gone(Exception):
    """The client left before its body was whole."""


async def _body(receive: Receive) -> bytes:
    parts, more = [], True
    while more:  # no more than its length: the server holds the client to it
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _Gone
        parts.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(parts)


async def _stream(send: Send, outgoing: Any, deadline: float) -> None:
    """The copy's files, one after the other, read off the event loop; each piece must
    leave within ``deadline`` seconds (a receiver that stops reading is cut off)."""
    total = 0
    opened = []
    try:
        for path in outgoing.files:  # the service's own folder: no link is followed
            opened.append(await run_io(os.open, path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC))
        sizes = [int(outgoing.headers[k]) for k in (copying.TAR_BYTES, copying.MANIFEST_BYTES)]
        total = sum(sizes)
        headers = [(k.encode(), v.encode()) for k, v in outgoing.headers.items()]
        headers += [
            (b"content-type", b"application/octet-stream"),
            (b"content-length", str(total).encode()),
            (b"connection", b"close"),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for fd, size in zip(opened, sizes, strict=True):
            offset = 0
            while offset < size:
                chunk = await run_io(os.pread, fd, min(SEND_CHUNK, size - offset), offset)
                if not chunk:  # cut short under us: the receiver finds it short
                    return
                offset += len(chunk)
                piece = {"type": "http.response.body", "body": chunk, "more_body": True}
                await asyncio.wait_for(send(piece), deadline)
        await send({"type": "http.response.body", "body": b""})
    finally:
        for fd in opened:
            os.close(fd)


async def _answer(send: Send, status: int, content: dict) -> None:
    body = json.dumps(content).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
