"""The prefetch port's places (``prefetch_listen``: docs/prestaging.md, "Threats on the
port"). A TCP connection names no user, only its source address, and proves who sent
it only once its whole request is in (the order's MUNGE credential is over its body).
So the port's :data:`~stager.prestage.prefetch.listener.MAX_CONNECTIONS` places are
shared by address (an IPv4-mapped IPv6 one is its IPv4 address: :func:`address_of`),
as nginx's ``limit_conn`` per ``$binary_remote_addr`` does: one
address holds at most ``prefetch_max_connections_per_address`` of them (a newcomer
past it takes the place of its own address's oldest connection whose request is not
yet whole: users on the planner's host cannot hold that address's places); and when
all are taken, a newcomer takes the place of a connection whose request is not yet
whole (idle, or trickling its head or its body), the oldest of the address that holds
the most, where that address holds more than the newcomer's. A connection whose
request is whole (read by the app, or its end seen by the parser), or younger than
:data:`FRESH_S`, is never displaced: it is answered within milliseconds (a refusal, an
order queued) or proven (a copy). The planner's connections send their request at
once, so nobody can hold the places it needs: before, one user's 64 idle connections,
renewed as they were closed, had 33 of 34 genuine orders refused 503.
"""

from __future__ import annotations

import ipaddress
import logging
import time
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from starlette.types import Receive, Scope, Send

from stager.api.connections import BurstLog, PeerHTTPProtocol, Refusal

log = logging.getLogger("stager.prestage.prefetch")

# A connection this young is not displaced: a genuine request (the planner's, a node's
# copy) is whole within a round trip of its accept, and one displaced before its first
# bytes arrive never had the chance to be.
FRESH_S = 1.0


def address_of(peer: Any) -> str:
    """The source address of a connection's ``peername``, one text per host: an IPv4 host
    reaching a dual-stack port shows as ``::ffff:10.0.0.5`` there and as ``10.0.0.5`` on
    an IPv4 one; both are ``10.0.0.5``, so that it holds one address's share, not two."""
    if not peer:
        return "?"
    text = str(peer[0])
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return text
    mapped = getattr(address, "ipv4_mapped", None)
    return str(mapped if mapped is not None else address)


class Places:
    """The port's connections, by source address, in the order they came."""

    def __init__(
        self,
        total: int,
        per_address: int,
        header_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total = total
        self.clock = clock
        self.per_address = min(per_address, total)
        self.header_timeout_s = header_timeout_s  # (read by the protocol's head timer)
        self.log = BurstLog(log)
        self._held: dict[str, list[OrdersProtocol]] = {}
        self._count = 0

    def held(self, address: str) -> int:
        return len(self._held.get(address, ()))

    def admit(self, connection: OrdersProtocol) -> Refusal | None:
        """Count ``connection`` (displacing another if all places are taken) and return
        None, or say why it is refused."""
        address = connection.address
        mine = self.held(address)
        if mine >= self.per_address:
            # Its own address's oldest not whole goes first: users on the planner's host
            # (a login node) cannot hold that address's places against its orders.
            own = self._waiting(self._held.get(address, []))
            if own is not None:
                self.release(own)
                own.displace(address)
                mine -= 1
        if mine >= self.per_address:
            return Refusal(
                "prefetch_max_connections_per_address",
                f"{address} holds {mine} connections to the prefetch port, the most one "
                f"address may (--prefetch-max-connections-per-address {self.per_address}); "
                "close some, then retry",
            )
        if self._count >= self.total:
            victim = self._victim(mine)
            if victim is None:
                return Refusal(
                    "prefetch_port_full",
                    f"the prefetch port holds its {self.total} connections, each with its "
                    f"whole request in or from an address holding no more than {address}'s "
                    f"{mine}; retry in a moment",
                )
            self.release(victim)
            victim.displace(address)
        self._held.setdefault(address, []).append(connection)
        self._count += 1
        return None

    def _victim(self, newcomer_holds: int) -> OrdersProtocol | None:
        """The oldest connection not yet whole of the address holding the most places,
        more than the newcomer's address: the places go to the addresses holding fewer."""
        best: tuple[tuple[int, float], OrdersProtocol] | None = None
        for connections in self._held.values():
            if len(connections) <= newcomer_holds:
                continue
            waiting = self._waiting(connections)
            if waiting is None:
                continue
            rank = (len(connections), -waiting.since)
            if best is None or rank > best[0]:
                best = (rank, waiting)
        return None if best is None else best[1]

    def _waiting(self, connections: list[OrdersProtocol]) -> OrdersProtocol | None:
        """The oldest of ``connections`` (in the order they came) that may be displaced:
        its request not whole (the app has not read it, nor the parser seen its end),
        and :data:`FRESH_S` had to send it."""
        now = self.clock()
        for connection in connections:
            cycle = getattr(connection, "cycle", None)  # uvicorn's request being parsed
            parsed = cycle is not None and not cycle.more_body
            if not (connection.whole or parsed) and now - connection.since >= FRESH_S:
                return connection
        return None

    def release(self, connection: OrdersProtocol) -> None:
        """``connection`` leaves its place (closed, or displaced)."""
        connections = self._held.get(connection.address)
        if connections is None or connection not in connections:
            return
        connections.remove(connection)
        if not connections:
            del self._held[connection.address]
        self._count -= 1


class OrdersProtocol(PeerHTTPProtocol):
    """The connection protocol of the prefetch port: counted by :class:`Places` under
    its source address, and whole once the app has read its request's last byte."""

    def __init__(self, *args: Any, gate: Places, **kwargs: Any) -> None:
        super().__init__(*args, gate=gate, **kwargs)  # type: ignore[arg-type]
        self.places = gate
        self.address = "?"
        self.since = 0.0
        self.whole = False  # its request all in: never displaced

    def _admit(self) -> Refusal | None:
        self.address = address_of(self.transport.get_extra_info("peername"))
        self.since = self.places.clock()
        refusal = self.places.admit(self)
        if refusal is None:
            app = self.app

            async def app_of_request(scope: Scope, receive: Receive, send: Send) -> None:
                async def receive_marking_whole() -> dict:
                    message = await receive()
                    if message["type"] == "http.request" and not message.get("more_body"):
                        self.whole = True
                    return message  # type: ignore[return-value]

                await app(scope, receive_marking_whole, send)

            self.app = app_of_request  # (inside the head's wrapper, set after this)
        return refusal

    def _release(self) -> None:
        self.places.release(self)

    def _who(self) -> str:
        return self.address

    def displace(self, newcomer: str) -> None:
        """Close this connection, whose request is not whole, for a newcomer's."""
        self.admitted = False  # its place is the newcomer's already
        if newcomer == self.address:
            sentence = (
                f"{self.address} held the most connections one address may "
                f"(--prefetch-max-connections-per-address {self.places.per_address}); this "
                "one's request was not yet whole, and its place went to a newer one of the "
                "same address (send a request whole, at once)"
            )
        else:
            sentence = (
                f"the prefetch port's places were all taken, and {self.address} held the "
                "most with requests not yet whole; this one's went to another address's "
                "connection (send a request whole, at once)"
            )
        self.places.log.event(
            ("displaced", self.address),
            f"closed a connection of {self.address} for one of {newcomer}: {sentence}",
        )
        if self.awaiting_head:
            self._disarm_head_timer()
            self._answer(HTTPStatus.SERVICE_UNAVAILABLE, "too_many_connections", sentence)
        else:  # the app reads its body: it is told the client left
            self.transport.close()
