"""Prefetches on a real node service, ordered with a real munged's credentials of root,
staged as real users (tests/users.py): a prefetch is its job's hit, reads only what the
job's user may read, yields to users' requests, and stays within its budgets."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from client._progress import describe_origin
from stager.core import vouch
from stager.engine.admission import PREFETCHING, FairQueue
from stager.wire.schemas import DatasetPublic
from tests.daemon import Daemon
from tests.httpserver import Behaviour, serve_files
from tests.munge import private_munged
from tests.users import User

NODE = "node1"


@pytest.fixture(scope="module")
def munge_socket() -> Iterator[Path]:
    with private_munged() as socket:
        yield socket


def start_service(cache: Path, munge_socket: Path, *args: str, **env: str) -> Daemon:
    daemon = Daemon(
        cache_dir=cache,
        args=["--multi-user", *args],
        extra_env={"STAGER_MUNGE_SOCKET": str(munge_socket), "STAGER_NODE_NAME": NODE, **env},
    )
    daemon.runtime_dir.chmod(0o755)
    return daemon.start()


@pytest.fixture
def service(users: tuple[User, User], shared_tmp: Path, munge_socket: Path) -> Iterator[Daemon]:
    daemon = start_service(shared_tmp / "cache", munge_socket)
    try:
        yield daemon
    finally:
        daemon.stop()
        daemon.cleanup()


def signed(body: dict, munge_socket: Path, by: User | None = None, ttl: int = 60) -> tuple:
    """The order's bytes and its Authorization header, the credential made by root (or
    by ``by``, a user) over the body's sha256."""
    raw = json.dumps(body).encode()
    payload = json.dumps({"what": "stager prefetch", "sha256": hashlib.sha256(raw).hexdigest()})
    if by is None:
        credential = vouch.encode(payload, munge_socket, ttl)
    else:
        argv = ["munge", "--socket", str(munge_socket), "--ttl", str(ttl), "--string", payload]
        credential = by.run(argv).stdout.strip()
    assert credential
    return raw, f"Munge {credential}"


def order(user: User, job: int, request: dict | None = None, action: str = "stage") -> dict:
    body = {"action": action, "job": job, "uid": user.uid, "gid": user.gid, "node": NODE}
    return body | ({"request": request} if request is not None else {})


def send(service: Daemon, raw: bytes, header: str) -> tuple[int, dict]:
    with service.client() as client:
        answer = client.post("/v1/prefetches", content=raw, headers={"authorization": header})
    return answer.status_code, answer.json()


def prefetch(service: Daemon, munge_socket: Path, body: dict) -> tuple[int, dict]:
    return send(service, *signed(body, munge_socket))


def private_tree(owner: User, root: Path, n_files: int = 5) -> Path:
    """A folder only ``owner`` may read."""
    root.mkdir(mode=0o700)
    for i in range(n_files):
        (root / f"f{i}.bin").write_bytes(os.urandom(4096))
    for path in [root, *root.iterdir()]:
        os.chown(path, owner.uid, owner.gid)
    return root


def wait(user: User, service: Daemon, name: str) -> dict:
    code, status = user.curl(service.socket, "GET", f"/v1/datasets/{name}/wait?timeout=60")
    assert code == 200, status
    return status


def metric(service: Daemon, name: str, label: str = "") -> float:
    with service.client() as client:
        text = client.get("/metrics").text
    found = re.search(rf"^{re.escape(name)}{re.escape(label)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def test_a_prefetch_as_alice_is_her_jobs_hit_with_the_same_key(
    service: Daemon, munge_socket: Path, users: tuple[User, User], shared_tmp: Path
) -> None:
    alice, _ = users
    src = private_tree(alice, shared_tmp / "alice-data")
    request = {"name": "mine", "steps": [{"op": "copy", "src": str(src)}]}
    code, answer = prefetch(service, munge_socket, order(alice, 42, request))
    assert code == 200, answer
    [done] = answer["data"]
    assert (done["state"], done["uid"], done["name"]) == ("active", alice.uid, "prefetch-42-mine")
    fetched = wait(alice, service, "prefetch-42-mine")
    assert fetched["state"] == "ready" and fetched["owner"] == alice.uid

    # The job's own request at its start: the same key, a hit, and said so.
    code, own = alice.curl(service.socket, "POST", "/v1/datasets", request)
    assert code == 200, own
    assert own["key"] == done["key"] == fetched["key"]
    assert own["origin"]["hit"] is True
    code, status = alice.curl(service.socket, "GET", "/v1/datasets/mine")
    assert status["prestaged_for_job"] == 42
    assert "pre-staged for job 42" in describe_origin(DatasetPublic.model_validate(status))
    # Used: the prefetch's own name went, the data stays under alice's.
    code, _ = alice.curl(service.socket, "GET", "/v1/datasets/prefetch-42-mine")
    assert code == 404
    assert metric(service, "stager_prefetches_total", '{outcome="used"}') == 1
    assert metric(service, "stager_prefetch_hidden_seconds_total") > 0
    assert metric(service, "stager_prefetch_bytes_total", '{outcome="used"}') > 0


def test_a_prefetch_reads_only_what_the_jobs_user_may_read(
    service: Daemon, munge_socket: Path, users: tuple[User, User], shared_tmp: Path
) -> None:
    alice, bob = users
    src = private_tree(bob, shared_tmp / "bobs-data")  # bob's alone (and root's)
    request = {"name": "theirs", "steps": [{"op": "copy", "src": str(src)}]}
    code, answer = prefetch(service, munge_socket, order(alice, 43, request))
    assert code in (400, 403), answer  # refused as alice's own request is
    _, own = alice.curl(service.socket, "POST", "/v1/datasets", request)
    assert own["error"]["type"] == answer["error"]["type"]
    code, _ = alice.curl(service.socket, "GET", "/v1/datasets/prefetch-43-theirs")
    assert code == 404
    assert not (service.cache_dir / "data").exists() or not any(
        p.name.endswith(".bin") for p in (service.cache_dir / "data").rglob("*")
    )


def test_a_user_request_overtakes_queued_prefetches(
    users: tuple[User, User], shared_tmp: Path, munge_socket: Path
) -> None:
    """One slot, held by a stalled download: a prefetch queued first, alice's own
    request after; when the slot frees, alice's request runs first."""
    alice, bob = users
    hold = threading.Event()
    files = {f"/{n}.bin": os.urandom(1024) for n in ("slow", "a", "b")}
    with serve_files(Behaviour(files=files, hold=hold)) as base:
        daemon = start_service(shared_tmp / "cache", munge_socket, "--max-workers", "1")
        try:

            def fetch(name: str, file: str) -> dict:
                return {
                    "name": name,
                    "steps": [{"op": "fetch", "url": f"{base}/{file}", "dst": "x"}],
                }

            code, _ = bob.curl(daemon.socket, "POST", "/v1/datasets", fetch("slow", "slow.bin"))
            assert code == 202
            code, answer = prefetch(daemon, munge_socket, order(bob, 7, fetch("later", "b.bin")))
            assert code == 200, answer
            code, _ = alice.curl(daemon.socket, "POST", "/v1/datasets", fetch("now", "a.bin"))
            assert code == 202
            hold.set()
            now = wait(alice, daemon, "now")
            assert now["state"] == "ready", now["error"]
            later = wait(bob, daemon, "prefetch-7-later")
            assert later["state"] == "ready", later["error"]
            # One slot: alice's ran first. (Not its state once hers is ready: the 1 KiB
            # prefetch may be done by then, and was, once, at a high load.)
            assert now["updated_at"] < later["updated_at"], (now, later)
        finally:
            hold.set()
            daemon.stop()
            daemon.cleanup()


def test_budgets_refuse_with_a_sentence_and_a_cancel_counts_the_waste(
    users: tuple[User, User], shared_tmp: Path, munge_socket: Path
) -> None:
    alice, _ = users
    daemon = start_service(
        shared_tmp / "cache", munge_socket, STAGER_PREFETCH_USER_BUDGET_BYTES="50000"
    )
    try:
        first = {
            "name": "one",
            "steps": [{"op": "copy", "src": str(private_tree(alice, shared_tmp / "d1"))}],
        }
        second = {
            "name": "two",
            "steps": [{"op": "copy", "src": str(private_tree(alice, shared_tmp / "d2", 10))}],
        }
        code, answer = prefetch(daemon, munge_socket, order(alice, 50, first))
        assert code == 200, answer
        wait(alice, daemon, "prefetch-50-one")
        code, answer = prefetch(daemon, munge_socket, order(alice, 51, second))
        assert code == 429, answer
        assert "budget" in answer["error"]["message"]
        assert "STAGER_PREFETCH_USER_BUDGET_BYTES" in answer["error"]["message"]
        code, _ = alice.curl(daemon.socket, "GET", "/v1/datasets/prefetch-51-two")
        assert code == 404

        # The planner re-targets job 50: cancelled, unused, counted as wasted.
        code, answer = prefetch(daemon, munge_socket, order(alice, 50, action="cancel"))
        assert code == 200, answer
        assert [p["state"] for p in answer["data"]] == ["wasted"]
        assert metric(daemon, "stager_prefetches_total", '{outcome="wasted"}') == 1
        assert metric(daemon, "stager_prefetch_bytes_total", '{outcome="wasted"}') == 5 * 4096
        code, _ = alice.curl(daemon.socket, "GET", "/v1/datasets/prefetch-50-one")
        assert code == 404
        # Its bytes are no longer in the budget: the second fits now.
        code, answer = prefetch(daemon, munge_socket, order(alice, 51, second))
        assert code == 200, answer
    finally:
        daemon.stop()
        daemon.cleanup()


def test_a_prefetch_survives_a_restart_and_its_credentials_stay_spent(
    users: tuple[User, User], shared_tmp: Path, munge_socket: Path
) -> None:
    alice, _ = users
    daemon = start_service(shared_tmp / "cache", munge_socket)
    try:
        request = {
            "name": "kept",
            "steps": [{"op": "copy", "src": str(private_tree(alice, shared_tmp / "k"))}],
        }
        raw, header = signed(order(alice, 60, request), munge_socket)
        code, answer = send(daemon, raw, header)
        assert code == 200, answer
        wait(alice, daemon, "prefetch-60-kept")
        daemon.restart()
        # munged's own replay cache still knows it; the service's record must too, when
        # munged restarts: checked by decoding the record rather than munged's answer.
        saved = json.loads((daemon.cache_dir / "prefetches.json").read_text())
        digest = hashlib.sha256(header.partition(" ")[2].encode()).hexdigest()
        assert digest in saved["seen"]
        code, answer = send(daemon, raw, header)
        assert code == 401, answer
        _, own = alice.curl(daemon.socket, "POST", "/v1/datasets", request)
        assert own["prestaged_for_job"] == 60
        assert own["origin"]["hit"] is True
        time.sleep(0)
    finally:
        daemon.stop()
        daemon.cleanup()


def test_a_prefetch_unused_past_its_expiry_is_dropped_as_wasted(
    users: tuple[User, User], shared_tmp: Path, munge_socket: Path
) -> None:
    alice, _ = users
    daemon = start_service(shared_tmp / "cache", munge_socket, STAGER_PREFETCH_EXPIRE_S="2")
    try:
        src = private_tree(alice, shared_tmp / "e")
        request = {"name": "old", "steps": [{"op": "copy", "src": str(src)}]}
        assert prefetch(daemon, munge_socket, order(alice, 80, request))[0] == 200
        wait(alice, daemon, "prefetch-80-old")
        time.sleep(2.5)
        # Any order sweeps (as the service's own sweep does every minute).
        code, answer = prefetch(daemon, munge_socket, order(alice, 81, action="cancel"))
        assert code == 200 and answer["data"] == [], answer
        assert metric(daemon, "stager_prefetches_total", '{outcome="wasted"}') == 1
        assert metric(daemon, "stager_prefetch_bytes_total", '{outcome="wasted"}') == 5 * 4096
        code, _ = alice.curl(daemon.socket, "GET", "/v1/datasets/prefetch-80-old")
        assert code == 404
    finally:
        daemon.stop()
        daemon.cleanup()


def test_the_fair_queue_serves_prefetches_last_until_a_request_asks_for_them() -> None:
    async def scenario() -> list[str]:
        queue = FairQueue()
        token = PREFETCHING.set(lambda estimate: None)  # a prefetch's budget: any
        queue.put("pre-a", 1)
        queue.put("pre-b", 1)
        PREFETCHING.reset(token)
        queue.put("own", 2)
        queue.put("pre-b", 2)  # user 2's own request for the data of a prefetch
        return [(await queue.get())[0] for _ in range(3)]

    # pre-b, asked for by a request now, runs in the first turn of its askers (user 1's,
    # as any join does); pre-a, a prefetch only, after every request.
    assert asyncio.run(scenario()) == ["pre-b", "own", "pre-a"]


def test_a_prefetch_past_its_budget_is_refused_before_anything_is_queued(
    users: tuple[User, User], shared_tmp: Path, munge_socket: Path
) -> None:
    alice, _ = users
    daemon = start_service(
        shared_tmp / "cache", munge_socket, STAGER_PREFETCH_NODE_BUDGET_BYTES="10000"
    )
    try:
        src = private_tree(alice, shared_tmp / "big")  # 5 x 4096 bytes
        request = {"name": "big", "steps": [{"op": "copy", "src": str(src)}]}
        code, answer = prefetch(daemon, munge_socket, order(alice, 55, request))
        assert code == 429, answer
        assert "STAGER_PREFETCH_NODE_BUDGET_BYTES" in answer["error"]["message"]
        # Refused in admission: no staging was queued (a miss), no name made, nothing written.
        assert metric(daemon, "stager_requests_total", '{outcome="miss"}') == 0
        assert metric(daemon, "stager_prefetches_total", '{outcome="refused"}') == 1
        assert metric(daemon, "stager_prefetches_total", '{outcome="started"}') == 0
        code, listed = alice.curl(daemon.socket, "GET", "/v1/datasets")
        assert code == 200 and listed["data"] == [], listed
        data = daemon.cache_dir / "data"
        assert not data.exists() or not any(p.name.endswith(".bin") for p in data.rglob("*"))
    finally:
        daemon.stop()
        daemon.cleanup()


def test_a_burst_of_prefetches_leaves_slots_to_a_running_jobs_request(
    users: tuple[User, User], shared_tmp: Path, munge_socket: Path
) -> None:
    """Three slots, three stalled prefetches ordered first (one user may run all three):
    only one of them stages (STAGER_PREFETCH_MAX_RUNNING, 1), so alice's running job's
    request starts at once, while the prefetches still stall."""
    alice, bob = users
    hold = threading.Event()
    stalled = Behaviour(files={f"/p{i}.bin": os.urandom(1024) for i in range(3)}, hold=hold)
    with serve_files(stalled) as held, serve_files(Behaviour(files={"/a.bin": b"a"})) as free:
        daemon = start_service(
            shared_tmp / "cache", munge_socket, "--max-workers", "3",
            "--max-stagings-per-user", "3",
        )  # fmt: skip
        try:
            for i in range(3):
                fetch = {
                    "name": f"p{i}",
                    "steps": [{"op": "fetch", "url": f"{held}/p{i}.bin", "dst": "x"}],
                }
                code, answer = prefetch(daemon, munge_socket, order(bob, 70 + i, fetch))
                assert code == 200, answer
            deadline = time.monotonic() + 30
            while stalled.requests == 0:  # the first prefetch is staging
                assert time.monotonic() < deadline
                time.sleep(0.1)
            own = {"name": "now", "steps": [{"op": "fetch", "url": f"{free}/a.bin", "dst": "x"}]}
            code, _ = alice.curl(daemon.socket, "POST", "/v1/datasets", own)
            assert code == 202
            code, now = alice.curl(daemon.socket, "GET", "/v1/datasets/now/wait?timeout=20")
            assert code == 200 and now["state"] == "ready", now
            states = sorted(
                bob.curl(daemon.socket, "GET", f"/v1/datasets/prefetch-{70 + i}-p{i}")[1]["state"]
                for i in range(3)
            )
            assert states == ["queued", "queued", "staging"]
            hold.set()
            for i in range(3):
                assert wait(bob, daemon, f"prefetch-{70 + i}-p{i}")["state"] == "ready"
        finally:
            hold.set()
            daemon.stop()
            daemon.cleanup()


def test_a_prefetch_requeued_by_a_restart_stays_behind_a_running_jobs_request(
    users: tuple[User, User], shared_tmp: Path, munge_socket: Path
) -> None:
    """One slot, held by bob's stalled download, alice's prefetch queued behind it; the
    service restarts (both are queued again); alice's job's own request, after the
    restart, still runs before her prefetch."""
    alice, bob = users
    hold = threading.Event()
    files = {f"/{n}.bin": os.urandom(1024) for n in ("slow", "a", "b")}
    with serve_files(Behaviour(files=files, hold=hold)) as base:
        daemon = start_service(shared_tmp / "cache", munge_socket, "--max-workers", "1")
        try:

            def fetch(name: str, file: str) -> dict:
                return {
                    "name": name,
                    "steps": [{"op": "fetch", "url": f"{base}/{file}", "dst": "x"}],
                }

            code, _ = bob.curl(daemon.socket, "POST", "/v1/datasets", fetch("slow", "slow.bin"))
            assert code == 202
            code, answer = prefetch(daemon, munge_socket, order(alice, 9, fetch("later", "b.bin")))
            assert code == 200, answer
            daemon.restart()
            code, _ = alice.curl(daemon.socket, "POST", "/v1/datasets", fetch("now", "a.bin"))
            assert code == 202
            hold.set()
            now = wait(alice, daemon, "now")
            later = wait(alice, daemon, "prefetch-9-later")
            assert now["state"] == later["state"] == "ready", (now, later)
            # One slot: the one made ready first ran first.
            assert now["updated_at"] < later["updated_at"], (now, later)
        finally:
            hold.set()
            daemon.stop()
            daemon.cleanup()


def test_a_failed_prefetch_holds_neither_budget_nor_lease(
    users: tuple[User, User], shared_tmp: Path, munge_socket: Path
) -> None:
    """alice's prefetch queued behind a stalled download, its source gone before it
    runs: it fails; the next order finds it failed, its name and lease gone, and its
    bytes out of her budget."""
    alice, bob = users
    hold = threading.Event()
    with serve_files(Behaviour(files={"/slow.bin": b"s" * 1024}, hold=hold)) as base:
        daemon = start_service(
            shared_tmp / "cache", munge_socket, "--max-workers", "1",
            STAGER_PREFETCH_USER_BUDGET_BYTES="30000",
        )  # fmt: skip
        try:
            slow = {
                "name": "slow",
                "steps": [{"op": "fetch", "url": f"{base}/slow.bin", "dst": "x"}],
            }
            code, _ = bob.curl(daemon.socket, "POST", "/v1/datasets", slow)
            assert code == 202
            gone = private_tree(alice, shared_tmp / "gone")  # 5 x 4096 bytes
            request = {"name": "gone", "steps": [{"op": "copy", "src": str(gone)}]}
            assert prefetch(daemon, munge_socket, order(alice, 91, request))[0] == 200
            for path in gone.iterdir():
                path.unlink()
            gone.rmdir()
            hold.set()
            assert wait(alice, daemon, "prefetch-91-gone")["state"] == "failed"

            other = private_tree(alice, shared_tmp / "other")  # as much again: in budget
            request = {"name": "other", "steps": [{"op": "copy", "src": str(other)}]}
            code, answer = prefetch(daemon, munge_socket, order(alice, 92, request))
            assert code == 200, answer
            code, _ = alice.curl(daemon.socket, "GET", "/v1/datasets/prefetch-91-gone")
            assert code == 404
            assert metric(daemon, "stager_prefetches_total", '{outcome="failed"}') == 1
            assert metric(daemon, "stager_prefetches_total", '{outcome="wasted"}') == 0
        finally:
            hold.set()
            daemon.stop()
            daemon.cleanup()


def test_each_prefetch_ends_once_and_its_waste_is_counted_once(
    users: tuple[User, User], shared_tmp: Path, munge_socket: Path, service: Daemon
) -> None:
    alice, _ = users
    size = 5 * 4096

    def ordered(job: int, name: str) -> dict:
        src = private_tree(alice, shared_tmp / name)
        request = {"name": name, "steps": [{"op": "copy", "src": str(src)}]}
        code, answer = prefetch(service, munge_socket, order(alice, job, request))
        assert code == 200, answer
        wait(alice, service, f"prefetch-{job}-{name}")
        return request

    def counted(outcome: str) -> tuple[float, float]:
        label = f'{{outcome="{outcome}"}}'
        return (
            metric(service, "stager_prefetches_total", label),
            metric(service, "stager_prefetch_bytes_total", label),
        )

    ordered(1, "a")
    used = ordered(2, "b")
    ordered(3, "c")
    for _ in range(2):  # cancelled twice (the planner sends again what it is not told done)
        assert prefetch(service, munge_socket, order(alice, 1, action="cancel"))[0] == 200
    assert counted("wasted") == (1, size)
    code, _ = alice.curl(service.socket, "POST", "/v1/datasets", used)  # job 2 starts here
    assert code == 200
    assert prefetch(service, munge_socket, order(alice, 2, action="cancel"))[0] == 200
    assert counted("used") == (1, size) and counted("wasted") == (1, size)
    # alice drops job 3's prefetch herself: wasted at the next order, once.
    for path in ("/leases", ""):
        code, answer = alice.curl(service.socket, "DELETE", f"/v1/datasets/prefetch-3-c{path}")
        assert code == 200, answer
    for job in (4, 4):
        assert prefetch(service, munge_socket, order(alice, job, action="cancel"))[0] == 200
    assert counted("wasted") == (2, 2 * size)
    assert counted("started") == (3, 3 * size)
    assert counted("failed") == (0, 0)


def test_prefetches_queued_for_a_users_pending_jobs_never_refuse_her_running_jobs_request(
    users: tuple[User, User], shared_tmp: Path, munge_socket: Path
) -> None:
    """The planner orders prefetches for alice's pending jobs, which queue behind the
    one prefetch slot (a stalled download) up to her queue's limit; her running job's
    own request is still taken (it would be without pre-staging), and a prefetch past
    the limit is the one refused (429: the planner sends it again later)."""
    alice, _ = users
    hold = threading.Event()
    stalled = Behaviour(files={f"/p{i}.bin": os.urandom(1024) for i in range(4)}, hold=hold)
    with serve_files(stalled) as held, serve_files(Behaviour(files={"/a.bin": b"a"})) as free:
        daemon = start_service(
            shared_tmp / "cache", munge_socket, "--max-workers", "3",
            "--max-queued-per-user", "2",
        )  # fmt: skip
        try:

            def fetch(i: int) -> dict:
                step = {"op": "fetch", "url": f"{held}/p{i}.bin", "dst": "x"}
                return {"name": f"p{i}", "steps": [step]}

            for i in range(3):  # one staging, two queued: her queue is full of prefetches
                code, answer = prefetch(daemon, munge_socket, order(alice, 90 + i, fetch(i)))
                assert code == 200, answer
            code, answer = prefetch(daemon, munge_socket, order(alice, 93, fetch(3)))
            assert code == 429, answer  # the prefetch past her limit: sent again later
            own = {"name": "now", "steps": [{"op": "fetch", "url": f"{free}/a.bin", "dst": "x"}]}
            code, answer = alice.curl(daemon.socket, "POST", "/v1/datasets", own)
            assert code == 202, answer
            code, now = alice.curl(daemon.socket, "GET", "/v1/datasets/now/wait?timeout=20")
            assert code == 200 and now["state"] == "ready", now
        finally:
            hold.set()
            daemon.stop()
            daemon.cleanup()


def test_a_job_id_slurm_gives_another_user_ends_the_first_users_prefetch_here(
    users: tuple[User, User], shared_tmp: Path, munge_socket: Path, service: Daemon
) -> None:
    """Slurm reuses a job id (its ids wrapped past MaxJobId, or its state was lost): the
    planner's order for bob's job 500 finds alice's prefetch for her job 500 of a dataset
    of the same name. Hers ends here (wasted: her job is gone), not left holding its
    name, its lease and its data outside the budgets until it expires."""
    alice, bob = users
    hers = {
        "name": "d",
        "steps": [{"op": "copy", "src": str(private_tree(alice, shared_tmp / "a"))}],
    }
    his = {"name": "d", "steps": [{"op": "copy", "src": str(private_tree(bob, shared_tmp / "b"))}]}
    assert prefetch(service, munge_socket, order(alice, 500, hers))[0] == 200
    wait(alice, service, "prefetch-500-d")
    code, answer = prefetch(service, munge_socket, order(bob, 500, his))
    assert code == 200, answer
    wait(bob, service, "prefetch-500-d")
    code, _ = alice.curl(service.socket, "GET", "/v1/datasets/prefetch-500-d")
    assert code == 404
    assert metric(service, "stager_prefetches_total", '{outcome="wasted"}') == 1
    # bob's job's cancel is his own: it ends his prefetch, and is not refused as another's.
    code, answer = prefetch(service, munge_socket, order(bob, 500, action="cancel"))
    assert code == 200 and [p["uid"] for p in answer["data"]] == [bob.uid], answer


def test_a_running_jobs_request_may_evict_data_that_only_a_prefetch_holds(
    users: tuple[User, User], shared_tmp: Path, munge_socket: Path
) -> None:
    """A prefetch's lease keeps its data from other prefetches, not from a running job:
    alice's pending job's prefetch fills the cache; bob's running job's own request
    needs room, and gets it by evicting that data (counted as wasted), as it would have
    without pre-staging. Before, its lease protected it, and bob's staging was refused."""
    alice, bob = users
    daemon = start_service(shared_tmp / "cache", munge_socket, STAGER_CAPACITY_BYTES="100000")
    try:
        hers = {
            "name": "h",
            "steps": [{"op": "copy", "src": str(private_tree(alice, shared_tmp / "a", 15))}],
        }
        assert prefetch(daemon, munge_socket, order(alice, 501, hers))[0] == 200
        assert wait(alice, daemon, "prefetch-501-h")["state"] == "ready"
        his = {
            "name": "b",
            "steps": [{"op": "copy", "src": str(private_tree(bob, shared_tmp / "b", 10))}],
        }
        code, answer = bob.curl(daemon.socket, "POST", "/v1/datasets", his)
        assert code in (200, 202), answer
        done = wait(bob, daemon, "b")
        assert done["state"] == "ready", done["error"]
        # The prefetch's end is found at the next order (or the minute's sweep): wasted.
        assert prefetch(daemon, munge_socket, order(alice, 502, action="cancel"))[0] == 200
        assert metric(daemon, "stager_prefetches_total", '{outcome="wasted"}') == 1
    finally:
        daemon.stop()
        daemon.cleanup()


def test_a_running_jobs_delivery_may_evict_data_that_only_a_prefetch_holds(
    users: tuple[User, User], shared_tmp: Path, munge_socket: Path
) -> None:
    """As its request may (above): room for a delivery of bob's running job's fan-out
    (POST /v1/incoming, what sbcast then writes) evicts alice's pending job's prefetch
    rather than be refused insufficient_space for room held for a job not started."""
    alice, bob = users
    daemon = start_service(shared_tmp / "cache", munge_socket, STAGER_CAPACITY_BYTES="100000")
    try:
        hers = {
            "name": "h",
            "steps": [{"op": "copy", "src": str(private_tree(alice, shared_tmp / "a", 15))}],
        }
        assert prefetch(daemon, munge_socket, order(alice, 503, hers))[0] == 200
        assert wait(alice, daemon, "prefetch-503-h")["state"] == "ready"
        room = {"label": "fanout", "bytes": 60000}
        code, answer = bob.curl(daemon.socket, "POST", "/v1/incoming", room)
        assert code == 200, answer
        assert prefetch(daemon, munge_socket, order(alice, 504, action="cancel"))[0] == 200
        assert metric(daemon, "stager_prefetches_total", '{outcome="wasted"}') == 1
    finally:
        daemon.stop()
        daemon.cleanup()


def test_one_users_long_prefetch_cannot_hold_the_nodes_prefetch_slot_from_another(
    users: tuple[User, User], shared_tmp: Path, munge_socket: Path
) -> None:
    """One prefetch slot (STAGER_PREFETCH_MAX_RUNNING, 1), a slot of 1 s
    (STAGER_PREFETCH_SLOT_S). bob's prefetch stalls (a download that never ends): alone,
    or with only his own next prefetch queued, it keeps the slot; once alice's waits, it
    is ended (counted as wasted) and hers stages."""
    alice, bob = users
    hold = threading.Event()
    stalled = Behaviour(files={"/p.bin": os.urandom(1024)}, hold=hold)
    # His next prefetch from a server of its own: it stages once alice's is done, and
    # its download must not count as the first one begun again.
    next_one = Behaviour(files={"/q.bin": b"q"}, hold=hold)
    with serve_files(stalled) as held, serve_files(next_one) as held_next:
        daemon = start_service(
            shared_tmp / "cache", munge_socket, "--max-workers", "2",
            STAGER_PREFETCH_SLOT_S="1",
        )  # fmt: skip
        try:
            for job, name, url in ((80, "p", held), (81, "q", held_next)):
                fetch = {
                    "name": name,
                    "steps": [{"op": "fetch", "url": f"{url}/{name}.bin", "dst": "x"}],
                }
                code, answer = prefetch(daemon, munge_socket, order(bob, job, fetch))
                assert code == 200, answer
            deadline = time.monotonic() + 30
            while stalled.requests == 0:  # his first prefetch is staging
                assert time.monotonic() < deadline
                time.sleep(0.1)
            time.sleep(2.5)  # past the slot, several sweeps: nobody else waits
            state = bob.curl(daemon.socket, "GET", "/v1/datasets/prefetch-80-p")[1]["state"]
            assert state == "staging"
            assert metric(daemon, "stager_prefetches_total", '{outcome="wasted"}') == 0

            tree = private_tree(alice, shared_tmp / "alice-data")
            request = {"name": "mine", "steps": [{"op": "copy", "src": str(tree)}]}
            code, answer = prefetch(daemon, munge_socket, order(alice, 82, request))
            assert code == 200, answer
            assert wait(alice, daemon, "prefetch-82-mine")["state"] == "ready"
            code, _ = bob.curl(daemon.socket, "GET", "/v1/datasets/prefetch-80-p")
            assert code == 404
            assert metric(daemon, "stager_prefetches_total", '{outcome="wasted"}') == 1
            assert "held a prefetch slot over 1 s" in daemon.log(None)
            # The planner sends a stage again each interval while its copies wait (its
            # answer says whether it is ready): the one ended is not begun again from
            # nothing, to be ended again at the next wait, again and again.
            asked = stalled.requests
            p = {"name": "p", "steps": [{"op": "fetch", "url": f"{held}/p.bin", "dst": "x"}]}
            code, answer = prefetch(daemon, munge_socket, order(bob, 80, p))
            assert code == 200, answer
            assert [x["state"] for x in answer["data"]] == ["wasted"], answer
            time.sleep(1.0)
            assert bob.curl(daemon.socket, "GET", "/v1/datasets/prefetch-80-p")[0] == 404
            assert stalled.requests == asked
        finally:
            hold.set()
            daemon.stop()
            daemon.cleanup()


def test_a_prefetch_a_request_joined_leaves_the_prefetch_slot_to_other_users(
    users: tuple[User, User], shared_tmp: Path, munge_socket: Path
) -> None:
    """bob's prefetch stalls in the node's one prefetch slot; his own request then asks
    for the same data, which makes that staging his request's (the slot rule ends it no
    more). The slot is then free: alice's prefetch stages, where before it waited behind
    his for as long as his download lasted."""
    alice, bob = users
    hold = threading.Event()
    stalled = Behaviour(files={"/p.bin": os.urandom(1024)}, hold=hold)
    with serve_files(stalled) as held:
        daemon = start_service(
            shared_tmp / "cache", munge_socket, "--max-workers", "2",
            STAGER_PREFETCH_SLOT_S="1",
        )  # fmt: skip
        try:
            steps = [{"op": "fetch", "url": f"{held}/p.bin", "dst": "x"}]
            code, answer = prefetch(
                daemon, munge_socket, order(bob, 90, {"name": "p", "steps": steps})
            )
            assert code == 200, answer
            deadline = time.monotonic() + 30
            while stalled.requests == 0:  # his prefetch is staging
                assert time.monotonic() < deadline
                time.sleep(0.1)
            code, joined = bob.curl(
                daemon.socket, "POST", "/v1/datasets", {"name": "his", "steps": steps}
            )
            assert code in (200, 202), joined
            assert joined["state"] == "staging", joined  # the same staging, joined

            tree = private_tree(alice, shared_tmp / "alice-data")
            request = {"name": "mine", "steps": [{"op": "copy", "src": str(tree)}]}
            code, answer = prefetch(daemon, munge_socket, order(alice, 91, request))
            assert code == 200, answer
            assert wait(alice, daemon, "prefetch-91-mine")["state"] == "ready"
            his = bob.curl(daemon.socket, "GET", "/v1/datasets/his")[1]["state"]
            assert his == "staging", "alice's prefetch waited until bob's download ended"
            assert metric(daemon, "stager_prefetches_total", '{outcome="wasted"}') == 0
        finally:
            hold.set()
            daemon.stop()
            daemon.cleanup()


def test_a_prefetch_ended_and_queued_again_before_the_queue_looked_still_stages(
    users: tuple[User, User], shared_tmp: Path, munge_socket: Path
) -> None:
    """Two workers, both busy: alice's prefetch (job 70) in the one prefetch slot, bob's
    stalled request in the other; her own request waits (her one staging at a time).
    Job 70's prefetch is cancelled: its worker takes her request at once, so no worker
    looks at the slot in between. Job 71's prefetch of the same data then queues that
    key again. Once the downloads go on, it stages: before, the queue still counted the
    key as its slot's holder (a queued key counted as still running), so neither it
    nor any later prefetch on the node ever staged (until a request asked for it)."""
    alice, bob = users
    hold = threading.Event()
    files = {f"/{n}.bin": os.urandom(1024) for n in ("p", "his", "hers")}
    served = Behaviour(files=files, hold=hold)

    def started(n: int) -> None:
        deadline = time.monotonic() + 30
        while served.requests < n:
            assert time.monotonic() < deadline, f"{n} downloads begun: {served.requests}"
            time.sleep(0.05)

    with serve_files(served) as base:
        daemon = start_service(shared_tmp / "cache", munge_socket, "--max-workers", "2")
        try:

            def fetch(name: str, file: str) -> dict:
                return {
                    "name": name,
                    "steps": [{"op": "fetch", "url": f"{base}/{file}", "dst": "x"}],
                }

            code, answer = prefetch(daemon, munge_socket, order(alice, 70, fetch("p", "p.bin")))
            assert code == 200, answer
            started(1)
            code, answer = bob.curl(daemon.socket, "POST", "/v1/datasets", fetch("his", "his.bin"))
            assert code == 202, answer
            started(2)
            hers = fetch("hers", "hers.bin")
            code, answer = alice.curl(daemon.socket, "POST", "/v1/datasets", hers)
            assert code == 202, answer  # queued: her one staging at a time is the prefetch
            code, answer = prefetch(daemon, munge_socket, order(alice, 70, action="cancel"))
            assert code == 200, answer
            started(3)  # her request took the cancelled prefetch's worker
            code, answer = prefetch(daemon, munge_socket, order(alice, 71, fetch("p", "p.bin")))
            assert code == 200, answer
            hold.set()
            for who, name in ((bob, "his"), (alice, "hers")):
                assert wait(who, daemon, name)["state"] == "ready"
            path = "/v1/datasets/prefetch-71-p/wait?timeout=20"
            code, again = alice.curl(daemon.socket, "GET", path)
            assert code == 200 and again["state"] == "ready", again
        finally:
            hold.set()
            daemon.stop()
            daemon.cleanup()
