"""The prefetch port's places (stager/api/prefetch_port.py): who is refused and
whose place a newcomer takes, shown with stand-ins for connections (the rule alone;
tests/stager/test_hostile_prefetch.py runs it over real sockets)."""

from __future__ import annotations

import itertools
from typing import Any

from stager.api.prefetch_port import FRESH_S, Places

clock = itertools.count()
NOW = 1e6  # the places' clock: every stand-in is older than FRESH_S unless told


class Parsed:
    more_body = False  # uvicorn's cycle once the parser saw the request's end


class Connection:
    def __init__(self, address: str, whole: bool = False, since: float | None = None) -> None:
        self.address = address
        self.whole = whole
        self.since = float(next(clock)) if since is None else since
        self.displaced_for: str | None = None

    def displace(self, newcomer: str) -> None:
        self.displaced_for = newcomer


def fill(places: Places, address: str, n: int, **kwargs: Any) -> list[Connection]:
    held = [Connection(address, **kwargs) for _ in range(n)]
    for connection in held:
        assert places.admit(connection) is None  # type: ignore[arg-type]
    return held


def test_one_address_holds_no_more_than_its_share() -> None:
    places = Places(total=8, per_address=3, header_timeout_s=1.0, clock=lambda: NOW)
    fill(places, "10.0.0.1", 2, whole=True)
    fill(places, "10.0.0.1", 1, since=NOW)  # just accepted
    refusal = places.admit(Connection("10.0.0.1"))  # type: ignore[arg-type]
    assert refusal is not None and refusal.limit == "prefetch_max_connections_per_address"
    assert "--prefetch-max-connections-per-address 3" in refusal.sentence
    assert places.admit(Connection("10.0.0.2")) is None  # type: ignore[arg-type]


def test_a_newcomer_takes_the_oldest_waiting_place_of_the_address_holding_the_most() -> None:
    places = Places(total=6, per_address=4, header_timeout_s=1.0, clock=lambda: NOW)
    a = fill(places, "10.0.0.1", 2)
    b_whole = fill(places, "10.0.0.2", 1, whole=True)
    b = fill(places, "10.0.0.2", 3)
    planner = Connection("10.0.0.9")
    assert places.admit(planner) is None  # type: ignore[arg-type]
    # 10.0.0.2 held the most (4): its oldest connection not yet whole went, not its whole one
    assert b[0].displaced_for == "10.0.0.9"
    assert b_whole[0].displaced_for is None and not any(c.displaced_for for c in a)
    assert places.held("10.0.0.2") == 3 and places.held("10.0.0.9") == 1
    places.release(b[0])  # (its close, later: counted once)
    assert places.held("10.0.0.2") == 3


def test_a_newcomer_displaces_nobody_holding_no_more_than_its_address_or_a_whole_request() -> None:
    places = Places(total=4, per_address=4, header_timeout_s=1.0, clock=lambda: NOW)
    fill(places, "10.0.0.1", 2)
    fill(places, "10.0.0.2", 2, whole=True)
    # 10.0.0.1 holds no more than the newcomer's address would: nobody is displaced
    refusal = places.admit(Connection("10.0.0.1"))  # type: ignore[arg-type]
    assert refusal is not None and refusal.limit == "prefetch_port_full"
    # another address: 10.0.0.1's oldest waiting one goes (10.0.0.2's are whole)
    first = places.admit(Connection("10.0.0.3"))  # type: ignore[arg-type]
    assert first is None and places.held("10.0.0.1") == 1
    refusal = places.admit(Connection("10.0.0.3"))  # type: ignore[arg-type]
    assert refusal is not None  # 10.0.0.1 now holds no more than 10.0.0.3
    # a fourth address: of two holding one each, the older connection goes
    assert places.admit(Connection("10.0.0.4")) is None  # type: ignore[arg-type]
    assert places.held("10.0.0.1") == 0 and places.held("10.0.0.3") == 1
    assert places.held("10.0.0.2") == 2


def test_a_connection_young_or_parsed_whole_is_never_displaced() -> None:
    """Between its accept and the app's read of its body, a genuine request (the
    planner's, sent whole at once) is young, then parsed: neither may be taken."""
    places = Places(total=3, per_address=3, header_timeout_s=1.0, clock=lambda: NOW)
    young = fill(places, "10.0.0.2", 1, since=NOW - FRESH_S / 2)
    parsed = fill(places, "10.0.0.2", 1)
    parsed[0].cycle = Parsed()  # type: ignore[attr-defined]
    waiting = fill(places, "10.0.0.2", 1)
    assert places.admit(Connection("10.0.0.9", whole=True)) is None  # type: ignore[arg-type]
    assert waiting[0].displaced_for == "10.0.0.9"
    assert young[0].displaced_for is None and parsed[0].displaced_for is None
    refusal = places.admit(Connection("10.0.0.8"))  # type: ignore[arg-type]
    assert refusal is not None and refusal.limit == "prefetch_port_full"


def test_past_its_share_a_newcomer_takes_its_own_addresss_oldest_waiting_place() -> None:
    """Users on the planner's host (a login node) share its address: their idle
    connections there cannot keep its orders out."""
    places = Places(total=8, per_address=3, header_timeout_s=1.0, clock=lambda: NOW)
    idle = fill(places, "10.0.0.1", 2)
    whole = fill(places, "10.0.0.1", 1, whole=True)
    planner = Connection("10.0.0.1")
    assert places.admit(planner) is None  # type: ignore[arg-type]
    assert idle[0].displaced_for == "10.0.0.1" and whole[0].displaced_for is None
    assert places.held("10.0.0.1") == 3
