"""The node service against users who reach past their own: real users (tests/users.py)
joining another's queued staging, reviving a cancelled name, learning of another's
private data from the cache's folders, its mounts or ``gc``, or evicting it.

Each test is an attack that worked on the service of an earlier release (f55a66a).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daemon import Daemon, node_service
from tests.httpserver import Behaviour, serve_files
from tests.users import User


def request(user: User, service: Daemon, method: str, path: str, body: object = None):
    return user.curl(service.socket, method, path, body)


def status(user: User, service: Daemon, name: str) -> dict:
    code, answer = request(user, service, "GET", f"/v1/datasets/{name}")
    assert code == 200, answer
    return answer


def wait(user: User, service: Daemon, name: str, timeout: float = 60) -> dict:
    code, answer = request(user, service, "GET", f"/v1/datasets/{name}/wait?timeout={timeout}")
    assert code == 200, answer
    return answer


def until_state(user: User, service: Daemon, name: str, state: str, timeout: float = 20) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        found = status(user, service, name)
        if found["state"] == state or time.monotonic() > deadline:
            assert found["state"] == state, found
            return found
        time.sleep(0.1)


def copy(name: str, src: Path) -> dict:
    return {"name": name, "steps": [{"op": "copy", "src": str(src)}]}


def fetch(name: str, url: str) -> dict:
    return {"name": name, "steps": [{"op": "fetch", "url": url, "dst": "s"}]}


def attempts(service: Daemon) -> list[str]:
    """The stagings under way (their attempts' folders), deletions aside."""
    partial = service.cache_dir / "partial"
    return [p.name for p in partial.iterdir() if not p.name.startswith("discarded-")]


def until_no_attempt(service: Daemon, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while attempts(service) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not attempts(service), "a staging no live name wants went on"


@pytest.fixture
def slow_files() -> Iterator[tuple[str, Behaviour]]:
    """Downloads of 400 KB at 20 KB/s: each takes its slot for 20 s. A query string
    makes each URL private to the user who asks for it."""
    behaviour = Behaviour(
        files={f"/slow-{i}.bin?x": b"s" * 400_000 for i in range(4)}, bytes_per_s=20_000
    )
    with serve_files(behaviour) as base:
        yield base, behaviour


# ---- fair joins: a join runs no later than the joiner's own turn ----------------------------


def test_a_join_of_a_queued_shared_staging_runs_in_the_joiners_own_turn(
    users: tuple[User, User], shared_tmp: Path, slow_files: tuple[str, Behaviour]
) -> None:
    """alice holds her one slot with a slow download of her own and queues a copy of a
    public folder behind it; bob asks for the same copy. A slot stands idle and bob has
    nothing else queued: his join runs at once, not after alice's download (20 s)."""
    alice, bob = users
    base, _ = slow_files
    public = shared_tmp / "public"
    public.mkdir(mode=0o755)
    (public / "seven").write_bytes(b"7 bytes")
    (public / "seven").chmod(0o644)
    with node_service(shared_tmp / "cache", "--max-workers", "2") as service:
        code, answer = request(
            alice, service, "POST", "/v1/datasets", fetch("slow", f"{base}/slow-0.bin?x")
        )
        assert code == 202, answer
        until_state(alice, service, "slow", "staging")
        code, answer = request(alice, service, "POST", "/v1/datasets", copy("pub", public))
        assert code == 202 and answer["state"] == "queued", answer  # alice is at her cap
        started = time.monotonic()
        code, answer = request(bob, service, "POST", "/v1/datasets", copy("pub", public))
        assert code in (200, 202), answer
        ready = wait(bob, service, "pub", timeout=30)
        took = time.monotonic() - started
        assert ready["state"] == "ready", ready
        assert took < 8, f"bob's join waited {took:.1f} s: alice's turn, not his own"
        assert status(alice, service, "slow")["state"] == "staging"  # still hers, running
        assert wait(alice, service, "pub", timeout=5)["state"] == "ready"  # one staging
        assert ready["key"] == status(alice, service, "pub")["key"]
        request(alice, service, "DELETE", "/v1/datasets/slow")


# ---- names: a cancelled name stays cancelled ----------------------------------------------------


def test_a_cancelled_name_stays_cancelled_whatever_another_name_asks(
    users: tuple[User, User], shared_tmp: Path, slow_files: tuple[str, Behaviour]
) -> None:
    """alice cancels ``ra`` and then stages ``rb`` with the same steps: ``ra`` stays
    cancelled (it showed "staging" again), and when she cancels ``rb`` too the staging
    stops (it went on under ``ra``). The other order: ``rb`` joins ``ra``'s staging and
    ``ra`` is cancelled: ``ra`` goes, the staging goes on for ``rb``, and stops at
    ``rb``'s cancel. A cancelled name is not leased, nor waited on."""
    alice, _ = users
    base, _ = slow_files
    url = f"{base}/slow-1.bin?x"
    with node_service(shared_tmp / "cache") as service:
        # cancel ra, then rb asks for the same data
        assert request(alice, service, "POST", "/v1/datasets", fetch("ra", url))[0] == 202
        until_state(alice, service, "ra", "staging")
        code, answer = request(alice, service, "DELETE", "/v1/datasets/ra")
        assert code == 200 and answer["state"] == "cancelled", answer
        code, answer = request(alice, service, "POST", "/v1/datasets", fetch("rb", url))
        assert code == 202, answer
        until_state(alice, service, "rb", "staging")
        assert status(alice, service, "ra")["state"] == "cancelled"
        assert wait(alice, service, "ra", timeout=30)["state"] == "cancelled"  # at once
        code, answer = request(alice, service, "POST", "/v1/datasets/ra/leases", {"holder": "j"})
        assert code == 409, answer
        code, answer = request(alice, service, "DELETE", "/v1/datasets/rb")
        assert code == 200 and answer["state"] == "cancelled", answer
        until_no_attempt(service)
        assert status(alice, service, "ra")["state"] == "cancelled"
        assert status(alice, service, "rb")["state"] == "cancelled"
        # ra asked again by its owner is hers again; its cancel's second DELETE forgets it
        for name in ("ra", "rb"):
            assert request(alice, service, "DELETE", f"/v1/datasets/{name}")[0] == 200
            assert request(alice, service, "GET", f"/v1/datasets/{name}")[0] == 404

        # rb joins ra's staging, then ra is cancelled
        assert request(alice, service, "POST", "/v1/datasets", fetch("ra", url))[0] == 202
        until_state(alice, service, "ra", "staging")
        assert request(alice, service, "POST", "/v1/datasets", fetch("rb", url))[0] == 202
        code, answer = request(alice, service, "DELETE", "/v1/datasets/ra")
        assert code == 200 and "its data stays" in answer["outcome"], answer
        assert request(alice, service, "GET", "/v1/datasets/ra")[0] == 404
        assert status(alice, service, "rb")["state"] == "staging"
        # Under way: its attempt's folder is made a moment after the state says staging.
        deadline = time.monotonic() + 15
        while not attempts(service) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert attempts(service)
        assert status(alice, service, "rb")["state"] == "staging"
        code, answer = request(alice, service, "DELETE", "/v1/datasets/rb")
        assert code == 200 and answer["state"] == "cancelled", answer
        until_no_attempt(service)


# ---- reach: what a user cannot list through the API, they cannot learn otherwise ---------------


def stage_ready(user: User, service: Daemon, body: dict) -> dict:
    code, answer = request(user, service, "POST", "/v1/datasets", body)
    assert code in (200, 202), answer
    ready = wait(user, service, body["name"])
    assert ready["state"] == "ready", ready
    return ready


def test_the_caches_folders_mounts_and_gc_tell_a_user_nothing_of_anothers_data(
    users: tuple[User, User], shared_tmp: Path, alice_home: Path
) -> None:
    """alice holds private copies (one no name shows any more, superseded by a newer
    version of her file) and a superseded shared one. bob can list neither data/ (it was
    0755, in a cache made by an earlier release) nor anything under the cache, finds no
    key of hers in the mounts, and his gc evicts nothing of hers and names none of her
    keys (it evicted them all and returned their keys). alice's gc takes her own
    superseded copy alone; the shared one is root's to collect."""
    alice, bob = users
    secret = alice_home / "secret"
    alice.run(["sh", "-c", f"mkdir -m 0700 {secret} && echo v1 > {secret}/notes"])
    public = shared_tmp / "public"
    public.mkdir(mode=0o755)
    (public / "f").write_bytes(b"v1")
    (public / "f").chmod(0o644)
    cache = shared_tmp / "cache"
    (cache / "data").mkdir(parents=True)
    (cache / "data").chmod(0o755)  # as an earlier release left it
    with node_service(cache) as service:
        first = stage_ready(alice, service, copy("p", secret))
        old, old_path = first["key"], Path(first["path"])
        alice.run(["sh", "-c", f"echo version-two > {secret}/notes"])
        new = stage_ready(alice, service, copy("p", secret))["key"]
        shared_old = stage_ready(alice, service, copy("s", public))["key"]
        (public / "f").write_bytes(b"version two")
        shared_new = stage_ready(alice, service, copy("s", public))["key"]
        assert len({old, new, shared_old, shared_new}) == 4
        keys = (old, new)

        assert (cache / "data").stat().st_mode & 0o777 == 0o711
        listing = bob.run(["ls", "-a", str(cache / "data")])
        assert listing.returncode != 0 and not any(k in listing.stdout for k in keys)
        found = bob.run(["find", str(cache)])
        assert not any(k in found.stdout + found.stderr for k in keys), found.stdout
        mounts = bob.run(["cat", "/proc/mounts", "/proc/self/mountinfo"])
        assert not any(k in mounts.stdout for k in keys)

        code, answer = request(bob, service, "POST", "/v1/gc", {})
        assert code == 200 and answer["evicted"] == [] and answer["freed_bytes"] == 0, answer
        assert old_path.is_dir() and (cache / "data" / shared_old).is_dir()

        code, answer = request(alice, service, "POST", "/v1/gc", {})
        assert code == 200 and answer["evicted"] == [old], answer  # her own, alone
        assert (cache / "data" / shared_old).is_dir()
        assert status(alice, service, "p")["state"] == "ready"
        code, answer = request(bob, service, "POST", "/v1/gc", {"all": True})
        assert code == 403, answer


def test_a_name_that_joins_a_staging_being_cancelled_is_not_cancelled_with_it(
    users: tuple[User, User], shared_tmp: Path
) -> None:
    """alice cancels ``ra`` while its download hangs (the staging takes its grace to
    stop) and asks for ``rb``, the same steps, meanwhile: ``rb`` joined a staging about
    to end cancelled, which it never asked for. The staging goes on for ``rb`` (it ended
    cancelled), and ``ra`` stays cancelled."""
    alice, _ = users
    hold = threading.Event()
    behaviour = Behaviour(files={"/held.bin?x": b"h" * 1000}, hold=hold)
    with (
        serve_files(behaviour) as base,
        node_service(shared_tmp / "cache", "--cancel-grace", "4") as service,
    ):
        url = f"{base}/held.bin?x"
        assert request(alice, service, "POST", "/v1/datasets", fetch("ra", url))[0] == 202
        until_state(alice, service, "ra", "staging")
        deadline = time.monotonic() + 10
        while behaviour.requests == 0 and time.monotonic() < deadline:
            time.sleep(0.05)  # the download hangs in the server
        argv = ["curl", "-s", "--unix-socket", str(service.socket), "-X", "DELETE"]
        cancelling = alice.popen([*argv, "http://stager/v1/datasets/ra"])
        try:
            time.sleep(0.5)
            code, answer = request(alice, service, "POST", "/v1/datasets", fetch("rb", url))
            assert code == 202 and answer["state"] == "staging", answer  # joined the cancel
        finally:
            cancelling.wait(30)
        hold.set()
        done = wait(alice, service, "rb")
        assert done["state"] == "ready", done
        assert status(alice, service, "ra")["state"] == "cancelled"


# ---- ended names: never charged, never keeping data --------------------------------------------


def test_data_only_a_cancelled_name_shows_is_collected_as_superseded(
    users: tuple[User, User], shared_tmp: Path, alice_home: Path
) -> None:
    """alice cancels ``ra`` while it waits for her slot; ``rb`` stages the same copy, then
    a newer version of it: only the cancelled ``ra`` still shows the first copy, which
    her gc kept for good."""
    alice, _ = users
    secret = alice_home / "secret"
    alice.run(["sh", "-c", f"mkdir -m 0700 {secret} && echo v1 > {secret}/notes"])
    hold = threading.Event()
    behaviour = Behaviour(files={"/held.bin?x": b"h" * 1000}, hold=hold)
    with (
        serve_files(behaviour) as base,
        node_service(shared_tmp / "cache", "--max-workers", "2") as service,
    ):
        blocker = fetch("blocker", f"{base}/held.bin?x")
        assert request(alice, service, "POST", "/v1/datasets", blocker)[0] == 202
        until_state(alice, service, "blocker", "staging")  # her one slot
        code, answer = request(alice, service, "POST", "/v1/datasets", copy("ra", secret))
        assert code == 202 and answer["state"] == "queued", answer
        code, answer = request(alice, service, "DELETE", "/v1/datasets/ra")
        assert code == 200 and answer["state"] == "cancelled", answer
        hold.set()
        assert wait(alice, service, "blocker")["state"] == "ready"
        old = stage_ready(alice, service, copy("rb", secret))["key"]
        assert status(alice, service, "ra")["key"] == old
        alice.run(["sh", "-c", f"echo version-two > {secret}/notes"])
        new = stage_ready(alice, service, copy("rb", secret))["key"]
        assert new != old and status(alice, service, "ra")["state"] == "cancelled"
        code, answer = request(alice, service, "POST", "/v1/gc", {})
        assert code == 200 and answer["evicted"] == [old], answer
