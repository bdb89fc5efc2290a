"""A multi-node job's prefetch read from the storage once (docs/prestaging.md, "4-node job"):
two real node services stand for the job's first planned node (node1, which stages from
the storage) and another one (node2, which copies from node1 before the job starts),
each with its prefetch port on TCP; a real munged; real users (tests/users.py).

What must hold: the copy is the job's hit on node2 with node2's own cache key, and node2
reads no storage; node1's port sends a copy only for the planner's copy credential (root
or SlurmUser, used once, naming node1 as the source) and only of node1's own prefetch of
that job for that user; a peer that sends wrong bytes, or bytes its service did not vouch
for, never makes a ready entry."""

from __future__ import annotations

import hashlib
import http.server
import io
import json
import os
import re
import socket
import tarfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from stager.core import vouch
from stager.ops import copy_from_node as copying
from stager.prestage.plan import service as plan_service
from stager.prestage.prefetch import authority
from stager.wire.manifest_format import Manifest, digest
from tests.daemon import Daemon, free_privileged_port
from tests.httpserver import Behaviour, serve_files
from tests.stager.test_prefetch import (
    munge_socket,  # noqa: F401 - the module's munged
    private_tree,
    start_service,
)
from tests.users import User

JOB = 4242


class Node:
    def __init__(self, daemon: Daemon, name: str, port: int, munge: Path) -> None:
        self.daemon, self.name, self.port, self.munge = daemon, name, port, munge

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def metric(self, name: str, label: str = "") -> float:
        with self.daemon.client() as client:
            text = client.get("/metrics").text
        found = re.search(rf"^{re.escape(name)}{re.escape(label)} (\S+)$", text, re.M)
        return float(found.group(1)) if found else 0.0


@pytest.fixture
def nodes(
    users: tuple[User, User],
    shared_tmp: Path,
    munge_socket: Path,  # noqa: F811
) -> Iterator[tuple[Node, Node]]:
    started: list[Node] = []
    try:
        for name in ("node1", "node2"):
            port = free_privileged_port()
            daemon = start_service(
                shared_tmp / name,
                munge_socket,
                "--prefetch-listen",
                f"127.0.0.1:{port}",
                STAGER_NODE_NAME=name,
            )
            started.append(Node(daemon, name, port, munge_socket))
        yield started[0], started[1]
    finally:
        for node in started:
            node.daemon.stop()
            node.daemon.cleanup()


def credential(body: bytes, what: str, socket: Path, by: User | None = None) -> str:
    payload = json.dumps({"what": what, "sha256": hashlib.sha256(body).hexdigest()})
    if by is None:
        made = vouch.encode(payload, socket, 60)
    else:
        argv = ["munge", "--socket", str(socket), "--ttl", "60", "--string", payload]
        made = by.run(argv).stdout.strip()
    assert made
    return f"Munge {made}"


def stage_order(user: User, job: int, request: dict, node: str = "node1") -> bytes:
    body = {"action": "stage", "job": job, "uid": user.uid, "gid": user.gid, "node": node}
    return json.dumps(body | {"request": request}).encode()


def copy_order(user: User, job: int, request: dict, origin: Node | str, **changed: object) -> bytes:
    """A copy to node2 from ``origin`` (a node, or an address standing for node1)."""
    address = origin.address if isinstance(origin, Node) else origin
    name = origin.name if isinstance(origin, Node) else "node1"
    body = {"action": "copy", "job": job, "uid": user.uid, "gid": user.gid, "node": "node2",
            "source": name, "source_address": address, "request": request}  # fmt: skip
    return json.dumps(body | changed).encode()


def order(node: Node, body: bytes, socket: Path, copy: bool = False) -> httpx.Response:
    """The planner's call: its credential, and for a copy the second one."""
    headers = {"authorization": credential(body, authority.WHAT, socket)}
    if copy:
        headers[authority.COPY_HEADER] = credential(body, authority.COPY, socket)
    with httpx.Client(timeout=60) as client:
        return client.post(f"http://{node.address}/v1/prefetches", content=body, headers=headers)


def ask_copy(
    node: Node, body: bytes, header: str | None, asker: str | None = "root"
) -> httpx.Response:
    """The copy's GET as a node service asks it: with its own (root's) credential over
    the body beside the copy credential; ``asker`` None: without one, else that header."""
    headers = {"authorization": header} if header else {}
    if asker == "root":
        asker = credential(body, authority.ASKER, node.munge)
    if asker is not None:
        headers[authority.ASKER_HEADER] = asker
    with httpx.Client(timeout=60) as client:
        return client.request("GET", f"http://{node.address}/v1/copies", content=body,
                              headers=headers)  # fmt: skip


def wait(user: User, node: Node, name: str) -> dict:
    code, status = user.curl(node.daemon.socket, "GET", f"/v1/datasets/{name}/wait?timeout=60")
    assert code == 200, status
    return status


def prefetched(node: Node, user: User, request: dict, socket: Path) -> dict:
    """``request`` ordered as job JOB's prefetch on ``node``, and its view once it ended."""
    assert order(node, stage_order(user, JOB, request), socket).status_code == 200
    return wait(user, node, f"prefetch-{JOB}-{request['name']}")


def test_the_planner_and_the_node_agree_on_the_copy_credentials_words() -> None:
    assert plan_service.WHAT == authority.WHAT
    assert plan_service.COPY == authority.COPY
    assert plan_service.COPY_HEADER == authority.COPY_HEADER


def test_a_copy_from_the_first_planned_node_is_the_jobs_hit_and_reads_no_storage(
    nodes: tuple[Node, Node],
    munge_socket: Path,  # noqa: F811
    users: tuple[User, User],
    shared_tmp: Path,
) -> None:
    node1, node2 = nodes
    alice, _ = users
    src = private_tree(alice, shared_tmp / "alice-data", n_files=8)
    request = {"name": "mine", "steps": [{"op": "copy", "src": str(src)}]}
    # The planner's intervals: the stage to the first node, sent again until its answer
    # says ready; then the copy to the other, which asks node1 at once.
    staged = order(node1, stage_order(alice, JOB, request), munge_socket)
    assert staged.status_code == 200, staged.text
    wait(alice, node1, f"prefetch-{JOB}-mine")
    again = order(node1, stage_order(alice, JOB, request), munge_socket)
    assert again.json()["data"][0]["ready"] is True, again.text
    copied = order(node2, copy_order(alice, JOB, request, node1), munge_socket, copy=True)
    assert copied.status_code == 200, copied.text
    [done] = copied.json()["data"]
    assert (done["state"], done["uid"]) == ("active", alice.uid)

    on1 = wait(alice, node1, f"prefetch-{JOB}-mine")
    on2 = wait(alice, node2, f"prefetch-{JOB}-mine")
    assert on1["state"] == on2["state"] == "ready", (on2["error"], on1["error"])
    assert on2["key"] == on1["key"] and on2["owner"] == alice.uid
    assert on2["origin"]["how"] == "broadcast" and on2["origin"]["node"] == "node1", on2

    # The job's own request on node2 at its start: a hit, on node2's own key.
    code, own = alice.curl(node2.daemon.socket, "POST", "/v1/datasets", request)
    assert code == 200, own
    assert own["key"] == on2["key"] and own["origin"]["hit"] is True
    for path in src.iterdir():
        assert (Path(own["path"]) / path.name).read_bytes() == path.read_bytes()
    # The storage was read by node1 alone; node2's bytes came from node1.
    assert node1.metric("stager_source_read_bytes_total") >= 8 * 4096
    assert node2.metric("stager_source_read_bytes_total") == 0
    assert node2.metric("stager_arrivals_total", '{how="broadcast"}') == 1
    assert node2.metric("stager_prefetches_total", '{outcome="used"}') == 1


def test_the_copy_port_sends_only_for_the_planners_copy_credential(
    nodes: tuple[Node, Node],
    munge_socket: Path,  # noqa: F811
    users: tuple[User, User],
    shared_tmp: Path,
) -> None:
    node1, node2 = nodes
    alice, bob = users
    src = private_tree(alice, shared_tmp / "alice-only")
    request = {"name": "mine", "steps": [{"op": "copy", "src": str(src)}]}
    assert prefetched(node1, alice, request, munge_socket)["state"] == "ready"
    body = copy_order(alice, JOB, request, node1)

    def refused(answer: httpx.Response, code: int, says: str) -> None:
        assert answer.status_code == code, answer.text
        assert says in answer.json()["error"]["message"], answer.text
        assert b"f0.bin" not in answer.content

    refused(ask_copy(node1, body, None), 401, "Authorization: Munge")
    # A user's own credential, over the genuine body: munge is everyone's.
    for by in (alice, bob):
        header = credential(body, authority.COPY, munge_socket, by=by)
        refused(ask_copy(node1, body, header), 401, "not by root or SlurmUser")
    # root's order credential (a stage's word) is not a copy's, on either route.
    refused(ask_copy(node1, body, credential(body, authority.WHAT, munge_socket)), 401,
            "not a 'stager prefetch copy' credential")  # fmt: skip
    with httpx.Client(timeout=60) as client:
        header = credential(body, authority.COPY, munge_socket)
        answer = client.post(f"http://{node2.address}/v1/prefetches", content=body,
                             headers={"authorization": header})  # fmt: skip
    refused(answer, 401, "not a 'stager prefetch' credential")
    # Genuine copy credentials that name another source, another user, another job.
    cases = [
        (copy_order(alice, JOB, request, node2.address, source="node3"), 403, "only the copy's"),
        (copy_order(bob, JOB, request, node1), 403, "another user's"),
        (copy_order(alice, JOB + 1, request, node1), 404, f"no prefetch of job {JOB + 1}"),
        (copy_order(alice, JOB, {**request, "name": "other"}, node1), 404, "no prefetch"),
    ]
    for other, code, says in cases:
        refused(ask_copy(node1, other, credential(other, authority.COPY, munge_socket)), code, says)
    # An altered body under a genuine credential.
    header = credential(body, authority.COPY, munge_socket)
    altered = copy_order(bob, JOB, request, node1)
    refused(ask_copy(node1, altered, header), 401, "not the one its credential signed")
    # The genuine one: sent once, then refused as used.
    header = credential(body, authority.COPY, munge_socket)
    answer = ask_copy(node1, body, header)
    assert answer.status_code == 200, answer.text
    assert int(answer.headers[copying.TAR_BYTES]) > 5 * 4096
    refused(ask_copy(node1, body, header), 401, "used already")
    # A copy order without its second credential is refused, and nothing is staged.
    with httpx.Client(timeout=60) as client:
        answer = client.post(f"http://{node2.address}/v1/prefetches", content=body,
                             headers={"authorization": credential(body, authority.WHAT,
                                                                  munge_socket)})  # fmt: skip
    refused(answer, 401, "Authorization: Munge")
    code, listing = alice.curl(node2.daemon.socket, "GET", "/v1/datasets")
    assert code == 200 and listing["count"] == 0, listing
    # What left node1 is the packed copy only: its exports are gone again.
    assert not any((shared_tmp / "node1").glob("outgoing/*/copy-*/*"))


class FakeSource(http.server.BaseHTTPRequestHandler):
    """Whatever answers on the source's address: a tar, a manifest and a credential of
    the test's choosing (server.answer)."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers.get("content-length", 0)))
        headers, data = self.server.answer  # type: ignore[attr-defined]
        self.send_response(200)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        stall = getattr(self.server, "stall", None)
        if stall is not None:  # the head only, then nothing until the test lets go
            self.wfile.flush()
            stall.wait(120)
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


def packed(files: dict[str, bytes]) -> tuple[bytes, bytes]:
    """A tar of ``files`` and the manifest of exactly them."""
    out, manifest = io.BytesIO(), Manifest()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
            manifest.files[name] = (len(data), hashlib.sha256(data).hexdigest())
    return out.getvalue(), manifest.to_bytes()


def test_a_peer_sending_wrong_or_unvouched_bytes_never_makes_a_ready_entry(
    nodes: tuple[Node, Node],
    munge_socket: Path,  # noqa: F811
    users: tuple[User, User],
    shared_tmp: Path,
) -> None:
    """node1's port is not node1's service any more (it stopped, and a user listens
    there): whatever it sends, node2 publishes nothing."""
    node1, node2 = nodes
    alice, _ = users
    src = private_tree(alice, shared_tmp / "alice-data")
    request = {"name": "mine", "steps": [{"op": "copy", "src": str(src)}]}
    key = prefetched(node1, alice, request, munge_socket)["key"]  # the same as node2's

    fake = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeSource)
    threading.Thread(target=fake.serve_forever, daemon=True).start()
    address = f"127.0.0.1:{fake.server_address[1]}"
    poison = {"f0.bin": b"poisoned by a peer"}
    genuine = {path.name: path.read_bytes() for path in sorted(src.iterdir())}

    def served(files: dict[str, bytes], signer: User | None, flip: bool = False,
               for_key: str = key) -> tuple[dict, bytes]:  # fmt: skip
        tar, manifest = packed(files)
        if flip:  # bytes changed on the way, after the manifest was made
            tar = tar.replace(files["f0.bin"][:64], bytes(64))
        sha = digest(manifest)
        payload = json.dumps({"what": vouch.WHAT, "key": for_key, "manifest_sha256": sha})
        argv = ["munge", "--socket", str(munge_socket), "--string", payload]
        made = signer.run(argv).stdout if signer else vouch.encode(payload, munge_socket, 60)
        headers = {copying.KEY: key, copying.TAR_BYTES: str(len(tar)),
                   copying.MANIFEST_BYTES: str(len(manifest)), copying.MANIFEST_SHA256: sha,
                   copying.MANIFEST_CREDENTIAL: made.strip()}  # fmt: skip
        return headers, tar + manifest

    cases = [
        (served(poison, alice), "made by uid"),  # a user's vouch: a user's port
        (served(poison, None, for_key="0" * 64), "vouches for"),  # another entry's vouch
        # Wrong bytes under a true manifest (changed on the way).
        (served(genuine, None, flip=True), "does not match the manifest"),
    ]
    try:
        # An unvouched head is refused before anything of its body is waited for or
        # written: the source stalls after its head, and the copy fails at once.
        fake.stall = threading.Event()  # type: ignore[attr-defined]
        fake.answer = served(poison, alice)  # type: ignore[attr-defined]
        body = copy_order(alice, JOB + 9, request, address)
        began = time.monotonic()
        assert order(node2, body, munge_socket, copy=True).status_code == 200
        status = wait(alice, node2, f"prefetch-{JOB + 9}-mine")
        assert status["state"] == "failed" and "made by uid" in status["error"]["message"], status
        assert time.monotonic() - began < 30  # not the 60 s a stalled body takes
        fake.stall.set()  # type: ignore[attr-defined]
        fake.stall = None  # type: ignore[attr-defined]
        for job, (answer, says) in enumerate(cases, start=JOB + 10):
            fake.answer = answer  # type: ignore[attr-defined]
            body = copy_order(alice, job, request, address)
            assert order(node2, body, munge_socket, copy=True).status_code == 200
            status = wait(alice, node2, f"prefetch-{job}-mine")
            assert status["state"] == "failed", status
            assert says in status["error"]["message"], status
    finally:
        if getattr(fake, "stall", None) is not None:
            fake.stall.set()  # type: ignore[attr-defined]
        fake.shutdown()
        fake.server_close()
    # Nothing of it is node2's data: alice's own request there is a miss, staged from
    # the storage, and byte-equal to it.
    code, own = alice.curl(node2.daemon.socket, "POST", "/v1/datasets", request)
    assert code == 202, own
    own = wait(alice, node2, "mine")
    assert own["state"] == "ready" and own["origin"]["how"] == "staged", own
    for path in src.iterdir():
        assert (Path(own["path"]) / path.name).read_bytes() == path.read_bytes()
    assert os.path.exists(own["path"])


def public_tree(root: Path, n_files: int = 4) -> Path:
    """A folder every user may read, on this node's own disk (no cluster storage)."""
    root.mkdir(mode=0o755)
    for i in range(n_files):
        (root / f"f{i}.bin").write_bytes(os.urandom(4096))
        (root / f"f{i}.bin").chmod(0o644)
    return root


def test_a_copy_of_node_local_sources_is_its_users_own_not_every_users(
    nodes: tuple[Node, Node],
    munge_socket: Path,  # noqa: F811
    users: tuple[User, User],
    shared_tmp: Path,
) -> None:
    """A path on a node's own disk (/tmp, /dev/shm) may hold other bytes on the source
    node under the same name, size and time: a copy of it must not become the entry
    every user of this node hits. Alice's copy on node2 is hers; bob's own request there
    is a miss, staged from what node2 itself holds."""
    node1, node2 = nodes
    alice, bob = users
    src = public_tree(shared_tmp / "local-data")
    request = {"name": "mine", "steps": [{"op": "copy", "src": str(src)}]}
    on1 = prefetched(node1, alice, request, munge_socket)
    assert on1["state"] == "ready", on1
    code, hit = bob.curl(node1.daemon.socket, "POST", "/v1/datasets", request)
    assert code == 200 and hit["key"] == on1["key"], hit  # every user's on node1
    copied = order(node2, copy_order(alice, JOB, request, node1), munge_socket, copy=True)
    assert copied.status_code == 200, copied.text
    on2 = wait(alice, node2, f"prefetch-{JOB}-mine")
    assert on2["state"] == "ready", on2["error"]
    assert on2["origin"]["how"] == "broadcast", on2
    assert on2["key"] != on1["key"]  # alice's own key on node2
    code, own = bob.curl(node2.daemon.socket, "POST", "/v1/datasets", request)
    assert code == 202, own  # a miss: nothing of node1's is bob's on node2
    assert wait(bob, node2, "mine")["origin"]["how"] == "staged"


def test_a_copy_credential_alone_is_refused_without_the_asking_services_own(
    nodes: tuple[Node, Node],
    munge_socket: Path,  # noqa: F811
    users: tuple[User, User],
    shared_tmp: Path,
) -> None:
    """A user who listened on node2's prefetch port while its service was down was sent
    a genuine copy credential: replayed to node1 alone, or with the user's own credential
    as the asker's, it is refused before it is spent, and stays good for node2's
    service's own ask."""
    node1, _ = nodes
    alice, bob = users
    src = private_tree(alice, shared_tmp / "alice-data")
    request = {"name": "mine", "steps": [{"op": "copy", "src": str(src)}]}
    assert prefetched(node1, alice, request, munge_socket)["state"] == "ready"
    body = copy_order(alice, JOB, request, node1)
    header = credential(body, authority.COPY, munge_socket)
    for asker, says in [
        (None, "Authorization: Munge"),
        (credential(body, authority.ASKER, munge_socket, by=bob), "not by root or SlurmUser"),
        (credential(body, authority.COPY, munge_socket), "not a 'stager prefetch copy asker'"),
    ]:
        answer = ask_copy(node1, body, header, asker)
        assert answer.status_code == 401, answer.text
        assert says in answer.json()["error"]["message"], answer.text
        assert b"f0.bin" not in answer.content
    answer = ask_copy(node1, body, header)
    assert answer.status_code == 200, answer.text


def test_the_op_and_the_source_agree_on_the_askers_words() -> None:
    assert (copying.ASKER, copying.ASKER_HEADER) == (authority.ASKER, authority.ASKER_HEADER)


@pytest.mark.parametrize("address", ["127.0.0.1:8766", "127.0.0.1:1024"])
def test_an_unprivileged_prefetch_port_is_refused_at_start(
    shared_tmp: Path,
    munge_socket: Path,  # noqa: F811
    address: str,
) -> None:
    daemon = Daemon(
        cache_dir=shared_tmp / "node-cache",
        args=["--multi-user", "--prefetch-listen", address],
        extra_env={"STAGER_MUNGE_SOCKET": str(munge_socket)},
    )
    try:
        daemon.start(wait=False)
        assert daemon.process is not None
        assert daemon.process.wait(30) != 0, daemon.log()
        log = daemon.log()
        assert "STAGER_PREFETCH_LISTEN (--prefetch-listen)" in log and "below 1024" in log, log
        assert "e.g. 866" in log and not daemon.socket.exists(), log
    finally:
        daemon.cleanup()


def test_a_copy_from_a_source_not_ready_holds_no_prefetch_slot_on_the_target(
    nodes: tuple[Node, Node],
    munge_socket: Path,  # noqa: F811
    users: tuple[User, User],
    shared_tmp: Path,
) -> None:
    """bob's prefetch on node1 stalls (its download hangs); a copy of it ordered on
    node2 anyway is answered at once (not ready yet) and fails there, instead of holding
    node2's one prefetch slot (STAGER_PREFETCH_MAX_RUNNING, 1) while node1 waits: alice's
    prefetch ordered on node2 after it is ready within seconds."""
    node1, node2 = nodes
    alice, bob = users
    hold = threading.Event()
    stalled = Behaviour(files={"/big.bin": os.urandom(1024)}, hold=hold)
    with serve_files(stalled) as base:
        slow = {"name": "slow", "steps": [{"op": "fetch", "url": f"{base}/big.bin", "dst": "x"}]}
        try:
            staged = order(node1, stage_order(bob, JOB, slow), munge_socket)
            assert staged.status_code == 200 and staged.json()["data"][0]["ready"] is False
            copy = copy_order(bob, JOB, slow, node1)
            assert order(node2, copy, munge_socket, copy=True).status_code == 200
            mine = private_tree(alice, shared_tmp / "alice-data")
            request = {"name": "mine", "steps": [{"op": "copy", "src": str(mine)}]}
            answer = order(node2, stage_order(alice, JOB + 1, request, node="node2"), munge_socket)
            assert answer.status_code == 200, answer.text
            code, status = alice.curl(
                node2.daemon.socket, "GET", f"/v1/datasets/prefetch-{JOB + 1}-mine/wait?timeout=20"
            )
            assert code == 200 and status["state"] == "ready", status
            # bob's copy failed at once (the next order on node2 ends failed ones).
            name = f"/v1/datasets/prefetch-{JOB}-slow"
            code, copied = bob.curl(node2.daemon.socket, "GET", name)
            if code == 200:
                assert copied["state"] == "failed", copied
                assert "not ready yet" in copied["error"]["message"], copied
            else:
                assert code == 404, copied
                assert node2.metric("stager_prefetches_total", '{outcome="failed"}') == 1
            assert stalled.requests >= 1 and not hold.is_set()  # node1's still stalls
        finally:
            hold.set()


def test_a_copy_reserves_the_tar_it_holds_beside_the_tree(
    users: tuple[User, User],
    shared_tmp: Path,
    munge_socket: Path,  # noqa: F811
) -> None:
    """The target holds the tar (up to twice the tree and 64 MiB) beside the tree while
    it extracts: admission counts both. A 32 MiB cache takes the 32 KiB tree, not the
    bound of its tar: the copy is refused there, not staged past the cache's size."""
    alice, _ = users
    port1, port2 = free_privileged_port(), free_privileged_port()
    started = []
    try:
        for name, port, extra in [
            ("node1", port1, {}),
            ("node2", port2, {"STAGER_CAPACITY_BYTES": str(32 << 20)}),
        ]:
            daemon = start_service(
                shared_tmp / name,
                munge_socket,
                "--prefetch-listen",
                f"127.0.0.1:{port}",
                STAGER_NODE_NAME=name,
                **extra,
            )
            started.append(Node(daemon, name, port, munge_socket))  # fmt: skip
        node1, node2 = started
        src = private_tree(alice, shared_tmp / "alice-data", n_files=8)
        request = {"name": "mine", "steps": [{"op": "copy", "src": str(src)}]}
        assert prefetched(node1, alice, request, munge_socket)["state"] == "ready"
        copied = order(node2, copy_order(alice, JOB, request, node1), munge_socket, copy=True)
        assert copied.status_code == 422, copied.text
        assert copied.json()["error"]["type"] == "insufficient_space", copied.text
    finally:
        for node in started:
            node.daemon.stop()
            node.daemon.cleanup()


def test_a_copy_whose_receiver_stops_reading_is_cut_off_and_its_export_dropped(
    users: tuple[User, User],
    shared_tmp: Path,
    munge_socket: Path,  # noqa: F811
) -> None:
    """A receiver takes the head and a few bytes of a 48 MiB copy, then reads nothing
    while it keeps its connection: past STAGER_PREFETCH_COPY_SEND_TIMEOUT_S (2 s here)
    the source cuts it off and drops the packed copy, rather than wait on it for good."""
    alice, _ = users
    port = free_privileged_port()
    daemon = start_service(
        shared_tmp / "node1", munge_socket, "--prefetch-listen", f"127.0.0.1:{port}",
        STAGER_NODE_NAME="node1", STAGER_PREFETCH_COPY_SEND_TIMEOUT_S="2",
    )  # fmt: skip
    node1 = Node(daemon, "node1", port, munge_socket)
    try:
        src = shared_tmp / "alice-big"
        src.mkdir(mode=0o700)
        for i in range(6):
            (src / f"f{i}.bin").write_bytes(os.urandom(8 << 20))
        for path in [src, *src.iterdir()]:
            os.chown(path, alice.uid, alice.gid)
        request = {"name": "mine", "steps": [{"op": "copy", "src": str(src)}]}
        assert prefetched(node1, alice, request, munge_socket)["state"] == "ready"
        body = copy_order(alice, JOB, request, node1)
        headers = {
            "authorization": credential(body, authority.COPY, munge_socket),
            authority.ASKER_HEADER: credential(body, authority.ASKER, munge_socket),
            "content-length": str(len(body)),
        }
        exports = shared_tmp / "node1"
        with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            head = "GET /v1/copies HTTP/1.1\r\nhost: node1\r\n" + "".join(
                f"{k}: {v}\r\n" for k, v in headers.items()
            )
            sock.sendall(head.encode() + b"\r\n" + body)
            assert sock.recv(64).startswith(b"HTTP/1.1 200")  # then nothing more is read
            deadline = time.monotonic() + 30
            while any(exports.glob("outgoing/*/copy-*/*")):
                assert time.monotonic() < deadline, "the packed copy stayed for a stalled reader"
                time.sleep(0.2)
        assert "cut off" in daemon.log()
    finally:
        daemon.stop()
        daemon.cleanup()
