"""The service's connections, bounded (docs/multiuser.md, "Connections, bodies and
downloads, bounded"): the protocol uvicorn runs for each connection
(:class:`PeerHTTPProtocol`) times a request's head (408 past ``header_timeout_s``),
counts connections against the caps of :class:`Gate` (root refused only at the
ceiling, half the descriptors; :func:`caps_for` lowers the caps to fit), answers a
refusal 503 at accept, before anything is read, and logs each burst once
(:class:`BurstLog`). Unbounded, one user's 20,000 half-sent requests took every
descriptor of the node service, and asyncio logged a traceback for each failed accept.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, NamedTuple

from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from stager.core.errors import error_content
from stager.core.identity import SCOPE_KEY, Caller
from stager.core.settings import Settings

log = logging.getLogger("stager.api.connections")

# Connections a job's client holds at once: a wait, an events stream, a status call.
# Users who hold fewer may take the reserved places.
FEW = 4
ROOT = 0


@dataclass(frozen=True)
class Caps:
    """The caps in force (the settings', lowered to fit the descriptors)."""

    total: int  # every user's connections together (root's aside, in the node service)
    per_user: int  # one uid's (node service)
    reserve: int  # the last places of ``total``, for users who hold fewer than FEW
    ceiling: int  # every connection, root's included: half the descriptors
    # The listening socket's queue, and so the most connections asyncio accepts at once
    # before any of them is counted here: a quarter of the descriptors at most.
    backlog: int = 2048
    multi_user: bool = False


def caps_for(settings: Settings, descriptors: int) -> tuple[Caps, list[str]]:
    """The caps for ``descriptors`` file descriptors, and a sentence for each setting
    lowered to fit: half for connections counted here (a quarter of it root's in the
    node service), a quarter for those accepted and not yet counted (the backlog), the
    rest the daemon's own."""
    ceiling = max(descriptors // 2, 2)
    most = ceiling - ceiling // 4 if settings.multi_user else ceiling
    notes = []
    total = settings.max_connections
    if total > most:
        notes.append(
            f"max_connections {total} lowered to {most}: connections may hold at most half "
            f"of the daemon's {descriptors} file descriptors (RLIMIT_NOFILE)"
            + (", a quarter of it kept for root" if settings.multi_user else "")
            + "; raise LimitNOFILE (systemd) or ulimit -n to allow more"
        )
        total = most
    caps = Caps(
        total=total,
        per_user=min(settings.max_connections_per_user, total),
        reserve=min(settings.connection_reserve, total),
        ceiling=ceiling,
        backlog=max(min(2048, descriptors // 4), 1),
        multi_user=settings.multi_user,
    )
    return caps, notes


class BurstLog:
    """One log line for a burst of like events: the first as it happens, the others
    counted and told once every ``every_s`` seconds while they go on."""

    def __init__(self, logger: logging.Logger, every_s: float = 10.0) -> None:
        self._log = logger
        self._every_s = every_s
        self._counts: dict[Hashable, int] = {}
        self._sentences: dict[Hashable, str] = {}

    def event(self, key: Hashable, sentence: str) -> None:
        if key in self._counts:
            self._counts[key] += 1
            return
        self._log.warning("%s", sentence)
        self._counts[key], self._sentences[key] = 0, sentence
        self._close_later(key)

    def _close_later(self, key: Hashable) -> None:
        asyncio.get_running_loop().call_later(self._every_s, self._close, key)

    def _close(self, key: Hashable) -> None:
        if key not in self._counts:
            return  # told by flush()
        if self._tell(key):
            self._counts[key] = 0  # still going: the next line in another window
            self._close_later(key)
        else:
            del self._counts[key], self._sentences[key]

    def _tell(self, key: Hashable) -> bool:
        count = self._counts[key]
        if count:
            sentence = self._sentences[key]
            self._log.warning("%d more like this since the last line: %s", count, sentence)
        return bool(count)

    def flush(self) -> None:
        """Tell the bursts still counting (at the daemon's stop)."""
        for key in list(self._counts):
            self._tell(key)
        self._counts.clear()
        self._sentences.clear()


class Refusal(NamedTuple):
    limit: str  # the setting that refused it
    sentence: str


class Gate:
    """Counts the open connections, by uid; says whether one more may open."""

    def __init__(self, caps: Caps, header_timeout_s: float) -> None:
        self.caps = caps
        self.header_timeout_s = header_timeout_s
        self.log = BurstLog(log)
        self._held: Counter[int | None] = Counter()
        self._users = 0  # counted against ``total``: everyone's but root's in the node service
        self._all = 0

    def _counts_against_total(self, uid: int | None) -> bool:
        return not (self.caps.multi_user and uid == ROOT)

    def admit(self, uid: int | None) -> Refusal | None:
        """Count a connection of ``uid`` (None: not known, TCP) and return None, or
        say why it is refused."""
        caps = self.caps
        counted = self._counts_against_total(uid)
        if counted:
            if self._users >= caps.total:
                return Refusal(
                    "max_connections",
                    f"the stager service holds {self._users} connections, its limit "
                    f"(--max-connections {caps.total}); retry in a moment",
                )
            held = self._held[uid]
            if caps.multi_user and held >= caps.per_user:
                return Refusal(
                    "max_connections_per_user",
                    f"uid {uid} holds {held} connections to the stager service, the most one "
                    f"user may (--max-connections-per-user {caps.per_user}); close some, then "
                    "retry",
                )
            if caps.multi_user and self._users >= caps.total - caps.reserve and held >= FEW:
                return Refusal(
                    "connection_reserve",
                    f"the stager service holds {self._users} of its {caps.total} connections "
                    f"and keeps the last {caps.reserve} for users who hold fewer than {FEW}, "
                    f"and uid {uid} holds {held} (--connection-reserve); close some, then retry",
                )
        if self._all >= caps.ceiling:
            return Refusal(
                "RLIMIT_NOFILE",
                f"the stager service holds {self._all} connections, all that its file "
                "descriptors allow (half of RLIMIT_NOFILE); retry in a moment, or have the "
                "admin raise LimitNOFILE",
            )
        if counted:
            self._users += 1
        self._held[uid] += 1
        self._all += 1
        return None

    def release(self, uid: int | None) -> None:
        """A connection that ``admit`` counted has closed."""
        self._held[uid] -= 1
        if not self._held[uid]:
            del self._held[uid]
        self._all -= 1
        if self._counts_against_total(uid):
            self._users -= 1


def quiet_accept_errors(loop: asyncio.AbstractEventLoop, burst: BurstLog) -> None:
    """asyncio logs a traceback for every accept that fails for want of descriptors
    (thousands a second while they lack): log those once per burst, with the fix."""
    previous = loop.get_exception_handler()

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if str(context.get("message", "")).startswith("socket.accept() out of system resource"):
            burst.event(
                "accept",
                f"could not accept a connection ({context.get('exception')}): the daemon's "
                "file descriptors are all in use; lower --max-connections, or raise "
                "LimitNOFILE",
            )
        elif previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


class PeerHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
    """uvicorn's HTTP protocol, bounded, and putting a Unix socket's peer (SO_PEERCRED,
    read once per connection; headers and bodies never enter into it) in every request's
    scope under ``identity.SCOPE_KEY``. It keeps to the hooks h11 and httptools share."""

    def __init__(self, *args: Any, gate: Gate, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate = gate
        self.uid: int | None = None
        self.admitted = False
        self.awaiting_head = True  # between requests: the next head is due
        self.head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        caller = None
        if sock is not None and sock.family == socket.AF_UNIX:
            caller = Caller.of_socket(sock)  # TCP: none (per-user mode's bearer token applies)
            self.uid = caller.uid
        refusal = self._admit()
        if refusal is not None:
            self.gate.log.event(
                ("refused", self._who(), refusal.limit), f"refused a connection: {refusal.sentence}"
            )
            self._answer(HTTPStatus.SERVICE_UNAVAILABLE, "too_many_connections", refusal.sentence)
            return
        self.admitted = True
        self._arm_head_timer()
        app = self.app

        async def app_of_connection(scope: Scope, receive: Receive, send: Send) -> None:
            self._head_arrived()
            if caller is not None:
                scope[SCOPE_KEY] = caller
            await app(scope, receive, send)

        self.app = app_of_connection

    def _admit(self) -> Refusal | None:
        """Count this connection with the gate, or say why it is refused."""
        return self.gate.admit(self.uid)

    def _release(self) -> None:
        self.gate.release(self.uid)

    def _who(self) -> str:
        """Whose connection this is, in the log."""
        return f"uid {self.uid}"

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._disarm_head_timer()
        if self.admitted:
            self.admitted = False
            self._release()

    def data_received(self, data: bytes) -> None:
        if not self.admitted:
            return  # refused: answered and closing
        if self.awaiting_head and self.head_timer is None:
            self._arm_head_timer()  # a kept-alive connection's next request begins
        super().data_received(data)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # The next head is timed from its first byte (data_received); until then the
        # connection is idle, which uvicorn's keep-alive timer bounds.
        self.awaiting_head = True

    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        self.head_timer = self.loop.call_later(self.gate.header_timeout_s, self._head_overdue)

    def _disarm_head_timer(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _head_arrived(self) -> None:
        self.awaiting_head = False
        self._disarm_head_timer()

    def _head_overdue(self) -> None:
        self.head_timer = None
        if self.transport.is_closing():
            return
        timeout = self.gate.header_timeout_s
        sentence = (
            f"the request's head did not arrive within {timeout:g} s of its start "
            "(--header-timeout); send the whole head at once"
        )
        self.gate.log.event(
            ("head", self._who()), f"closed a connection of {self._who()}: {sentence}"
        )
        self._answer(HTTPStatus.REQUEST_TIMEOUT, "header_timeout", sentence)

    def _answer(self, status: HTTPStatus, type_: str, sentence: str) -> None:
        """Answer ``status`` in the API's error shape outside any request, and close."""
        body = json.dumps(error_content(type_, sentence)).encode()
        head = [
            f"HTTP/1.1 {status.value} {status.phrase}",
            "content-type: application/json",
            f"content-length: {len(body)}",
            "connection: close",
        ]
        if status == HTTPStatus.SERVICE_UNAVAILABLE:
            head.append("retry-after: 1")
        self.transport.write("\r\n".join(head).encode() + b"\r\n\r\n" + body)
        self.transport.close()
