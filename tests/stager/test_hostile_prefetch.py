"""Users attacking the prefetch call of a real node service: each forgery is refused with
a sentence and changes nothing (no dataset, no name, the credential not spent for the
genuine call when it was not accepted).

The attacker is alice, a real user (tests/users.py), with her own munge credentials
from the same munged as the planner's (as on a cluster: munge is every user's), and a
genuine credential of root's she caught on its way (a replay)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from stager.api.prefetch_port import FRESH_S
from stager.prestage.prefetch import listener
from tests.daemon import Daemon, free_privileged_port
from tests.stager.test_hostile_users import stopped_user_processes
from tests.stager.test_prefetch import (
    munge_socket,  # noqa: F401 - the module's munged
    order,
    prefetch,
    private_tree,
    send,
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


# ---- the prefetch port (--prefetch-listen): TCP, reachable by anyone on the network ----


def raw_request(port: int, head: str, body: bytes = b"", timeout: float = 5.0) -> tuple[int, dict]:
    """``head`` sent as is (its body, if any, only as far as ``body`` goes), and the
    answer read until the service closes: an answer to a request whose announced body
    was never sent proves the body was not waited for."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(head.replace("\n", "\r\n").encode() + b"\r\n" + body)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2])


# Addresses of this host other than the planner's (127.0.0.1): all of 127/8 is loopback.
STRANGERS = ("127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5")


def connect_from(address: str, port: int) -> socket.socket:
    sock = socket.socket()
    sock.settimeout(10)
    sock.bind((address, 0))
    sock.connect(("127.0.0.1", port))
    return sock


@pytest.fixture
def port_service(
    users: tuple[User, User],
    shared_tmp: Path,
    munge_socket: Path,  # noqa: F811
) -> Iterator[tuple[Daemon, int]]:
    port = free_privileged_port()
    daemon = start_service(
        shared_tmp / "cache", munge_socket, "--prefetch-listen", f"127.0.0.1:{port}"
    )
    try:
        yield daemon, port
    finally:
        daemon.stop()
        daemon.cleanup()


def test_the_prefetch_port_answers_nothing_but_a_proven_order(
    port_service: tuple[Daemon, int],
    munge_socket: Path,  # noqa: F811
    users: tuple[User, User],
    shared_tmp: Path,
    bobs_data: dict,
) -> None:
    service, port = port_service
    alice, bob = users
    nothing_here = {"error": {"type": "not_found", "message": listener.NOT_HERE}}
    huge = "content-length: 1000000000\ncontent-type: application/json\n"
    for method, path in [
        ("GET", "/metrics"), ("GET", "/readyz"), ("GET", "/healthz"), ("GET", "/v1/datasets"),
        ("GET", "/v1/datasets/loot"), ("GET", "/docs"), ("GET", "/openapi.json"),
        ("GET", "/v1/whoami"), ("GET", "/v1/prefetches"), ("PUT", "/v1/prefetches"),
        ("DELETE", "/v1/prefetches"), ("POST", "/v1/datasets"), ("POST", "/v1/prefetches/x"),
        ("POST", "/v1/prefetches/"), ("POST", "//v1/prefetches"),
    ]:  # fmt: skip
        head = f"{method} {path} HTTP/1.1\nhost: node1\n{huge}"
        assert raw_request(port, head) == (404, nothing_here), (method, path)

    # The route itself: no credential, 401 before the (never sent) body.
    head = f"POST /v1/prefetches HTTP/1.1\nhost: node1\n{huge}"
    code, answer = raw_request(port, head)
    assert code == 401 and "Authorization: Munge" in answer["error"]["message"], answer
    code, _ = raw_request(port, head.replace("\n", "\nauthorization: Bearer x\n", 1))
    assert code == 401
    # A credential's shape, and a body over the bound or of no stated length: unread.
    munge = "authorization: Munge MUNGE:x\n"
    code, answer = raw_request(port, head.replace("\n", f"\n{munge}", 1))
    assert code == 413 and "at most 65536 bytes" in answer["error"]["message"], answer
    chunked = f"POST /v1/prefetches HTTP/1.1\nhost: n\n{munge}transfer-encoding: chunked\n"
    assert raw_request(port, chunked)[0] == 411

    # alice's own credential: refused, as on the socket.
    raw, header = signed(order(bob, 90, bobs_data), munge_socket, by=alice)
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
        answer = client.post("/v1/prefetches", content=raw, headers={"authorization": header})
        assert answer.status_code == 401
        assert "not by root or SlurmUser" in answer.json()["error"]["message"]
        nothing_staged(bob, service)

        # root's genuine order: carried out once; replayed, refused.
        mine = private_tree(alice, shared_tmp / "alice-only")
        request = {"name": "m", "steps": [{"op": "copy", "src": str(mine)}]}
        raw, header = signed(order(alice, 91, request), munge_socket)
        answer = client.post("/v1/prefetches", content=raw, headers={"authorization": header})
        assert answer.status_code == 200, answer.text
        assert answer.json()["data"][0]["name"] == "prefetch-91-m"
        again = client.post("/v1/prefetches", content=raw, headers={"authorization": header})
        assert again.status_code == 401 and "used already" in again.json()["error"]["message"]
    # The socket's API is the node service's as ever.
    code, status = alice.curl(service.socket, "GET", "/v1/datasets/prefetch-91-m")
    assert code == 200 and status["owner"] == alice.uid, status


def test_the_prefetch_port_is_refused_by_a_per_user_daemon_and_on_a_taken_address(
    users: tuple[User, User],
    shared_tmp: Path,
    munge_socket: Path,  # noqa: F811
) -> None:
    port = free_privileged_port()
    argv = [sys.executable, "-m", "stager", "serve", "--prefetch-listen", f"127.0.0.1:{port}"]
    env = os.environ | {"STAGER_RUNTIME_DIR": str(shared_tmp / "run"),
                        "STAGER_CACHE_DIR": str(shared_tmp / "cache")}  # fmt: skip
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert "is for the node service only" in done.stderr and "leave it out" in done.stderr

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        for address, says in [
            (f"127.0.0.1:{port}", "cannot listen there (Address already in use)"),
            ("nowhere.invalid:866", "nowhere.invalid is not an address"),
        ]:
            daemon = Daemon(
                cache_dir=shared_tmp / "node-cache",
                args=["--multi-user", "--prefetch-listen", address],
                extra_env={"STAGER_MUNGE_SOCKET": str(munge_socket)},
            )
            try:
                daemon.start(wait=False)
                assert daemon.process is not None
                assert daemon.process.wait(30) == 1, daemon.log()
                assert says in daemon.log() and "--prefetch-listen" in daemon.log(), daemon.log()
                assert not daemon.socket.exists()  # nothing served at all
            finally:
                daemon.cleanup()


def test_slow_bodies_on_the_prefetch_port_are_cut_off_and_the_planner_gets_in(
    users: tuple[User, User],
    shared_tmp: Path,
    munge_socket: Path,  # noqa: F811
) -> None:
    """64 strangers (16 on each of four addresses) each send a head and 2 bytes of a
    body, then nothing: each is answered 408 within the header timeout and closed, and
    the planner's order that follows is carried out (before, they held every place for
    good: 503)."""
    alice, _ = users
    port = free_privileged_port()
    service = start_service(
        shared_tmp / "cache", munge_socket, "--prefetch-listen", f"127.0.0.1:{port}",
        STAGER_HEADER_TIMEOUT_S="1",
    )  # fmt: skip
    slow: list[socket.socket] = []
    try:
        head = ("POST /v1/prefetches HTTP/1.1\r\nhost: n\r\nauthorization: Munge MUNGE:x\r\n"
                "content-length: 100\r\n\r\nab")  # fmt: skip
        started = time.monotonic()
        for i in range(listener.MAX_CONNECTIONS):
            sock = connect_from(STRANGERS[i % len(STRANGERS)], port)
            sock.sendall(head.encode())
            slow.append(sock)
        for sock in slow:
            answer = b""
            while chunk := sock.recv(65536):  # read until the service closes
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 408"), answer
            assert b"STAGER_HEADER_TIMEOUT_S" in answer
        assert time.monotonic() - started < 8
        mine = private_tree(alice, shared_tmp / "alice-only")
        request = {"name": "m", "steps": [{"op": "copy", "src": str(mine)}]}
        raw, header = signed(order(alice, 95, request), munge_socket)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            answer = client.post("/v1/prefetches", content=raw, headers={"authorization": header})
        assert answer.status_code == 200, answer.text
    finally:
        for sock in slow:
            sock.close()
        service.stop()
        service.cleanup()


def test_a_user_who_stops_her_own_process_holds_up_no_other_users_prefetch_order(
    users: tuple[User, User],
    shared_tmp: Path,
    munge_socket: Path,  # noqa: F811
    alice_home: Path,
) -> None:
    """alice (a job of hers runs on the node) stops (SIGSTOP) the process that checks
    her requests' sources as her; the planner's order for her next job then waits on it
    for the user process's timeout (20 s here, 60 s by default). bob's order meanwhile
    is carried out within the planner's 5 s (stager.prestage.plan.service's
    SEND_TIMEOUT_S): it waited behind hers before, as did every order to the node each
    interval hers was sent again."""
    alice, bob = users
    service = start_service(shared_tmp / "cache", munge_socket, STAGER_USER_PROCESS_TIMEOUT_S="20")
    stopped: list[int] = []
    answers: list[tuple[int, dict]] = []
    mine = private_tree(alice, shared_tmp / "alice-only")
    hers = signed(
        order(alice, 97, {"name": "m", "steps": [{"op": "copy", "src": str(mine)}]}), munge_socket
    )
    first = threading.Thread(target=lambda: answers.append(send(service, *hers)))
    try:
        stopped = stopped_user_processes(alice, service, alice_home)
        first.start()
        time.sleep(1.0)  # her order waits on her stopped process
        assert not answers, answers
        bobs = private_tree(bob, shared_tmp / "bob-only")
        began = time.monotonic()
        code, answer = prefetch(
            service,
            munge_socket,
            order(bob, 98, {"name": "b", "steps": [{"op": "copy", "src": str(bobs)}]}),
        )
        took = time.monotonic() - began
        assert code == 200, answer
        assert took < 5.0, f"bob's order took {took:.1f} s, behind alice's"
        first.join(60)
        assert answers and answers[0][0] == 504, answers  # hers fails alone, at its deadline
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        if first.is_alive():
            first.join(60)
        service.stop()
        service.cleanup()


class Crowd:
    """Strangers holding as many of the port's places as they can, from ``addresses``:
    idle connections, heads sent a byte at a time, and heads with a body begun and never
    ended; each connection the service closes (timed out, refused, displaced) is opened
    again at once, for as long as the crowd runs."""

    HEAD = (b"POST /v1/prefetches HTTP/1.1\r\nhost: n\r\nauthorization: Munge MUNGE:x\r\n"
            b"content-length: 100\r\n\r\n")  # fmt: skip

    def __init__(self, port: int, addresses: tuple[str, ...], per_address: int) -> None:
        self.port = port
        self.slots = [(a, i % 3) for a in addresses for i in range(per_address)]
        self.socks: list[socket.socket | None] = [None] * len(self.slots)
        self.sent = [0] * len(self.slots)
        self.opened = 0
        self.answers: list[bytes] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Crowd:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        self.thread.join(30)
        for sock in self.socks:
            if sock is not None:
                sock.close()

    def _run(self) -> None:
        while not self.stop.is_set():
            for i, (address, kind) in enumerate(self.slots):
                sock = self.socks[i]
                if sock is not None and self._closed(sock):
                    sock.close()
                    sock = self.socks[i] = None
                if sock is None:
                    try:
                        sock = self.socks[i] = connect_from(address, self.port)
                    except OSError:
                        continue
                    self.opened += 1
                    self.sent[i] = 0
                    if kind == 2:  # a whole head and 2 bytes of its body
                        sock.sendall(self.HEAD + b"ab")
                if kind == 1 and self.sent[i] < len(self.HEAD):  # the head, byte by byte
                    with contextlib.suppress(OSError):
                        sock.send(self.HEAD[self.sent[i] : self.sent[i] + 1])
                        self.sent[i] += 1
            time.sleep(0.05)

    def _closed(self, sock: socket.socket) -> bool:
        sock.setblocking(False)
        try:
            data = sock.recv(65536)
        except BlockingIOError:
            return False
        except OSError:
            return True
        finally:
            sock.settimeout(10)
        if data:
            self.answers.append(data)
        return True  # an answer: the service closes after it

    def held(self) -> int:
        return sum(sock is not None for sock in self.socks)


@pytest.mark.skipif(
    Path("/proc/sys/net/ipv6/bindv6only").read_text().strip() != "0",
    reason="[::] is IPv6 only on this host (net.ipv6.bindv6only): no dual-stack port",
)
def test_an_ipv4_host_on_a_dual_stack_port_holds_its_ipv4_addresss_share(
    users: tuple[User, User],
    shared_tmp: Path,
    munge_socket: Path,  # noqa: F811
) -> None:
    """The port listens on [::], where 127.0.0.9's connections show as ::ffff:127.0.0.9:
    they hold 127.0.0.9's share (2 here), and the third takes the place of that
    address's oldest, whose 503 names 127.0.0.9, as on an IPv4 port. Before, the mapped
    text was an address of its own (a host seen both ways held two shares)."""
    port = free_privileged_port()
    service = start_service(
        shared_tmp / "cache", munge_socket, "--prefetch-listen", f"[::]:{port}",
        STAGER_PREFETCH_MAX_CONNECTIONS_PER_ADDRESS="2",
    )  # fmt: skip
    try:
        with contextlib.ExitStack() as stack:
            held = [stack.enter_context(connect_from("127.0.0.9", port)) for _ in range(2)]
            time.sleep(FRESH_S + 0.5)  # neither has sent a request
            stack.enter_context(connect_from("127.0.0.9", port))
            answer = held[0].recv(65536)
        assert answer.startswith(b"HTTP/1.1 503"), answer
        assert b"127.0.0.9 held the most connections one address may" in answer, answer
        assert b"::ffff:" not in answer, answer
    finally:
        service.stop()
        service.cleanup()


def test_strangers_holding_the_prefetch_ports_places_cannot_keep_the_planner_out(
    port_service: tuple[Daemon, int],
    munge_socket: Path,  # noqa: F811
    users: tuple[User, User],
) -> None:
    """Strangers on four other addresses keep 160 connections open to the port (idle,
    trickling their heads, or a body begun), reopening each the moment it closes. The
    planner's orders, one at a time and 8 at once, are all carried out: a connection
    whose request is not whole gives its place to another address's newcomer, and one
    address holds at most 32 places (a 33rd takes its own address's oldest waiting
    one). Before, every place was theirs: 503."""
    service, port = port_service
    alice, _ = users
    per_address = 32
    with contextlib.ExitStack() as stack:  # one address: 32 places, not one more
        held = [stack.enter_context(connect_from("127.0.0.9", port)) for _ in range(per_address)]
        time.sleep(FRESH_S + 0.5)  # none of them has sent a request
        # The 33rd from the same address (users on the planner's host share its address)
        # takes the place of that address's oldest connection whose request is not whole.
        stack.enter_context(connect_from("127.0.0.9", port))
        answer = held[0].recv(65536)
        assert answer.startswith(b"HTTP/1.1 503"), answer
        assert b"went to a newer one of the same address" in answer, answer
        for sock in held[1:]:  # still open, unanswered
            sock.setblocking(False)
            with pytest.raises(BlockingIOError):
                sock.recv(1)

    job = iter(range(200, 400))
    with Crowd(port, STRANGERS, per_address=40) as crowd:
        time.sleep(2.0)  # the crowd holds what it can
        assert crowd.held() >= 64, crowd.held()
        codes: list[int] = []
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:

            def one() -> int:
                raw, header = signed(order(alice, next(job), action="cancel"), munge_socket)
                return client.post(
                    "/v1/prefetches", content=raw, headers={"authorization": header}
                ).status_code

            for _ in range(10):
                codes.append(one())
                time.sleep(0.2)
            burst: list[int] = []
            threads = [threading.Thread(target=lambda: burst.append(one())) for _ in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60)
            codes += burst
        opened = crowd.opened
    assert codes == [200] * 18, codes
    assert opened > 160, opened  # the crowd was turned away and came back, all along
    log = service.log(limit=None)
    assert "held the most with requests not yet whole" in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]


def test_a_job_id_given_to_another_user_while_an_order_for_it_waits_leaves_nothing_held(
    users: tuple[User, User],
    shared_tmp: Path,
    munge_socket: Path,  # noqa: F811
    alice_home: Path,
) -> None:
    """alice's order for her job 600 waits on her process (stopped, then let go); bob's
    order for his job 600 (Slurm gave him the id meanwhile) is booked beside it. Hers,
    booked last, must end his: before, it took his place in the book, and his name, lease
    and data stayed outside the budgets until they expired, out of reach of his cancel."""
    alice, bob = users
    service = start_service(shared_tmp / "cache", munge_socket, STAGER_USER_PROCESS_TIMEOUT_S="30")
    stopped: list[int] = []
    answers: list[tuple[int, dict]] = []
    mine = private_tree(alice, shared_tmp / "alice-only")
    hers = signed(
        order(alice, 600, {"name": "d", "steps": [{"op": "copy", "src": str(mine)}]}), munge_socket
    )
    first = threading.Thread(target=lambda: answers.append(send(service, *hers)))
    try:
        stopped = stopped_user_processes(alice, service, alice_home)
        first.start()
        time.sleep(1.0)  # her order waits on her stopped process
        bobs = private_tree(bob, shared_tmp / "bob-only")
        his = order(bob, 600, {"name": "d", "steps": [{"op": "copy", "src": str(bobs)}]})
        code, answer = prefetch(service, munge_socket, his)
        assert code == 200, answer
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        first.join(60)
        assert answers and answers[0][0] == 200, answers
        # bob's job's cancel ends what the node holds for job 600: nothing stays named.
        code, answer = prefetch(service, munge_socket, order(bob, 600, action="cancel"))
        assert code == 200, answer
        for user in (alice, bob):
            code, status = user.curl(service.socket, "GET", "/v1/datasets/prefetch-600-d")
            assert code == 404, (user.name, status)
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        if first.is_alive():
            first.join(60)
        service.stop()
        service.cleanup()
