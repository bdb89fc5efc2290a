"""Users attacking the prefetch call of a real node service: each forgery is refused with
a sentence and changes nothing (no dataset, no name, the credential not spent for the
genuine call when it was not accepted).

The attacker is alice, a real user (tests/users.py), with her own munge credentials
from the same munged as the planner's (as on a cluster: munge is every user's), and a
genuine credential of root's she caught on its way (a replay)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daemon import Daemon
from tests.stager.test_prefetch import (
    munge_socket,  # noqa: F401 - the module's munged
    order,
    private_tree,
    signed,
    start_service,
)
from tests.users import User


@pytest.fixture
def service(
    users: tuple[User, User],
    shared_tmp: Path,
    munge_socket: Path,  # noqa: F811
) -> Iterator[Daemon]:
    daemon = start_service(shared_tmp / "cache", munge_socket)
    try:
        yield daemon
    finally:
        daemon.stop()
        daemon.cleanup()


def as_alice(alice: User, service: Daemon, raw: bytes, header: str) -> tuple[int, dict]:
    """The order sent by alice herself over the node service's socket."""
    argv = ["curl", "-s", "-o", "-", "-w", "\n%{http_code}", "--unix-socket", str(service.socket)]
    argv += ["-X", "POST", "http://stager/v1/prefetches", "-H", f"authorization: {header}"]
    argv += ["-H", "content-type: application/json", "--data-binary", "@-"]
    done = alice.run(argv, input=raw.decode())
    text, _, code = done.stdout.rpartition("\n")
    return int(code), json.loads(text)


def nothing_staged(user: User, service: Daemon) -> None:
    code, listing = user.curl(service.socket, "GET", "/v1/datasets")
    assert code == 200 and listing["count"] == 0, listing


@pytest.fixture
def bobs_data(users: tuple[User, User], shared_tmp: Path) -> dict:
    _, bob = users
    src = private_tree(bob, shared_tmp / "bob-only")
    return {"name": "loot", "steps": [{"op": "copy", "src": str(src)}]}


def test_alices_own_credential_cannot_order_a_prefetch_as_bob(
    service: Daemon,
    munge_socket: Path,  # noqa: F811
    users: tuple[User, User],
    bobs_data: dict,
) -> None:
    alice, bob = users
    for victim in (bob, alice):  # as bob, to read his data; as herself, to jump the queue
        raw, header = signed(order(victim, 70, bobs_data), munge_socket, by=alice)
        code, answer = as_alice(alice, service, raw, header)
        assert code == 401, answer
        assert "not by root or SlurmUser" in answer["error"]["message"]
    nothing_staged(bob, service)
    nothing_staged(alice, service)


def test_no_credential_or_another_scheme_is_refused(
    service: Daemon, users: tuple[User, User], bobs_data: dict
) -> None:
    alice, bob = users
    raw = json.dumps(order(bob, 71, bobs_data)).encode()
    for header in ("", "Bearer x", "Munge ", "Munge not-a-credential"):
        code, answer = as_alice(alice, service, raw, header or "x-none: 1")
        assert code == 401, (header, answer)
        assert answer["error"]["message"]
    nothing_staged(bob, service)


def test_a_genuine_credential_with_an_altered_body_is_refused(
    service: Daemon,
    munge_socket: Path,  # noqa: F811
    users: tuple[User, User],
    shared_tmp: Path,
) -> None:
    """Root signed a prefetch of alice's own data for alice; alice swaps in bob's uid,
    another request, another job: refused, nothing is done."""
    alice, bob = users
    mine = private_tree(alice, shared_tmp / "alice-only")
    genuine = order(alice, 72, {"name": "mine", "steps": [{"op": "copy", "src": str(mine)}]})
    raw, header = signed(genuine, munge_socket)
    for altered in (
        genuine | {"uid": bob.uid, "gid": bob.gid},
        genuine | {"request": {"name": "mine", "steps": [{"op": "copy", "src": "/etc"}]}},
        genuine | {"job": 73},
    ):
        code, answer = as_alice(alice, service, json.dumps(altered).encode(), header)
        assert code == 401, answer
        message = answer["error"]["message"]
        # The first altered body is told it is not the signed one; by then munged has
        # seen the credential, and calls it used for every later try.
        assert "not the one its credential signed" in message or "used already" in message
    nothing_staged(bob, service)
    nothing_staged(alice, service)
    # A credential this node has decoded is spent whatever its body: the planner's own
    # call with it is refused too (it sends a fresh one at its next interval), and
    # refused again as a replay after a fresh one went through.
    code, answer = as_alice(alice, service, raw, header)
    assert code == 401, answer
    fresh = signed(genuine, munge_socket)
    assert as_alice(alice, service, *fresh)[0] == 200
    code, answer = as_alice(alice, service, *fresh)
    assert code == 401 and "used already" in answer["error"]["message"], answer


def test_a_replayed_cancel_or_stage_is_refused(
    service: Daemon,
    munge_socket: Path,  # noqa: F811
    users: tuple[User, User],
    shared_tmp: Path,
) -> None:
    """Root's stage, then root's cancel, both caught by alice: replaying the stage after
    the cancel must not stage again (the job went away)."""
    alice, _ = users
    mine = private_tree(alice, shared_tmp / "alice-only")
    stage = signed(
        order(alice, 74, {"name": "m", "steps": [{"op": "copy", "src": str(mine)}]}), munge_socket
    )
    cancel = signed(order(alice, 74, action="cancel"), munge_socket)
    assert as_alice(alice, service, *stage)[0] == 200
    assert as_alice(alice, service, *cancel)[0] == 200
    for replayed in (stage, cancel):
        code, answer = as_alice(alice, service, *replayed)
        assert code == 401 and "used already" in answer["error"]["message"], answer
    code, status = alice.curl(service.socket, "GET", "/v1/datasets/prefetch-74-m")
    assert code == 404, status


def test_a_credential_for_another_node_is_refused(
    service: Daemon,
    munge_socket: Path,  # noqa: F811
    users: tuple[User, User],
    bobs_data: dict,
) -> None:
    alice, bob = users
    raw, header = signed(order(bob, 75, bobs_data) | {"node": "node2"}, munge_socket)
    code, answer = as_alice(alice, service, raw, header)
    assert code == 403, answer
    assert "'node2'" in answer["error"]["message"]
    nothing_staged(bob, service)


def test_a_long_lived_or_expired_credential_and_root_as_the_jobs_user_are_refused(
    service: Daemon,
    munge_socket: Path,  # noqa: F811
    users: tuple[User, User],
    bobs_data: dict,
) -> None:
    alice, bob = users
    raw, header = signed(order(bob, 76, bobs_data), munge_socket, ttl=86400)
    code, answer = as_alice(alice, service, raw, header)
    assert code == 401 and "longer than this node accepts" in answer["error"]["message"], answer
    raw, header = signed(order(bob, 79, bobs_data), munge_socket, ttl=1)
    time.sleep(2.5)
    code, answer = as_alice(alice, service, raw, header)
    assert code == 401 and "expired" in answer["error"]["message"], answer
    as_root = order(bob, 77, bobs_data) | {"uid": 0, "gid": 0}
    code, answer = as_alice(alice, service, *signed(as_root, munge_socket))
    assert code == 403 and "never stages as root" in answer["error"]["message"], answer
    wrong_group = order(bob, 78, bobs_data) | {"gid": os.getgid()}  # root's group
    code, answer = as_alice(alice, service, *signed(wrong_group, munge_socket))
    assert code == 403 and "is not a group of" in answer["error"]["message"], answer
    nothing_staged(bob, service)
