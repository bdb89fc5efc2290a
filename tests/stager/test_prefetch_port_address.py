"""The prefetch port's source addresses (stager/api/prefetch_port.py, address_of): one
text per host, so that a host holds one address's share of the port's places
(tests/stager/test_hostile_prefetch.py sees it over a real dual-stack socket)."""

from __future__ import annotations

import pytest

from stager.api.prefetch_port import Places, address_of


@pytest.mark.parametrize(
    ("peer", "address"),
    [
        (("10.0.0.5", 40000), "10.0.0.5"),
        (("::ffff:10.0.0.5", 40000, 0, 0), "10.0.0.5"),  # IPv4 on a dual-stack port
        (("::FFFF:0A00:0005", 40000, 0, 0), "10.0.0.5"),  # the same, spelled otherwise
        (("2001:DB8:0::1", 40000, 0, 0), "2001:db8::1"),
        (("fe80::1%eth0", 40000, 0, 2), "fe80::1%eth0"),
        (None, "?"),  # (a transport that names no peer)
        (("not an address", 0), "not an address"),
    ],
)
def test_a_hosts_address_is_one_text_however_its_connection_shows_it(peer, address) -> None:
    assert address_of(peer) == address


class Connection:
    def __init__(self, peer: tuple) -> None:
        self.address = address_of(peer)
        self.whole = True  # (never displaced: the share alone decides)
        self.since = 0.0

    def displace(self, newcomer: str) -> None:
        raise AssertionError("a whole connection is never displaced")


def test_an_ipv4_host_seen_both_ways_holds_one_share() -> None:
    """Before, ::ffff:10.0.0.5 and 10.0.0.5 were two addresses: four places, not two."""
    places = Places(total=8, per_address=2, header_timeout_s=1.0, clock=lambda: 1e6)
    assert places.admit(Connection(("10.0.0.5", 1))) is None  # type: ignore[arg-type]
    assert places.admit(Connection(("::ffff:10.0.0.5", 2, 0, 0))) is None  # type: ignore[arg-type]
    refusal = places.admit(Connection(("::ffff:10.0.0.5", 3, 0, 0)))  # type: ignore[arg-type]
    assert refusal is not None and refusal.limit == "prefetch_max_connections_per_address"
    assert refusal.sentence.startswith("10.0.0.5 holds 2 connections"), refusal.sentence
    assert places.held("10.0.0.5") == 2
