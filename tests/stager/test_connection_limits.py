"""Every connection is bounded, in a daemon of one user as in the node service: the
time its request's head may take, its idle time between requests, the number open
at once, and its request body's size, each a setting. Real daemons, real sockets:
requests are written by hand where a client library would not misbehave enough.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.daemon import Daemon
from tests.flood import Flood

pytestmark = pytest.mark.forked_daemons  # its daemons: tests/daemon_zygote.py

HEAD = b"GET /v1/datasets HTTP/1.1\r\nHost: stager\r\n"


@pytest.fixture
def bounded(daemon_factory: Callable[..., Daemon]) -> Daemon:
    return daemon_factory(
        env={
            "STAGER_HEADER_TIMEOUT": "1",
            "STAGER_KEEP_ALIVE_TIMEOUT": "1",
            "STAGER_MAX_CONNECTIONS": "20",
            "STAGER_MAX_BODY_BYTES": str(64 * 1024),
        }
    )


def connect(daemon: Daemon, timeout: float = 6.0) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    sock.connect(str(daemon.socket))
    return sock


def read_until_closed(sock: socket.socket) -> tuple[bytes, float]:
    """Everything the daemon sends until it closes the connection, and when it did
    (seconds from now); fails when it keeps it open past the socket's timeout."""
    t0, data = time.monotonic(), b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        pytest.fail(f"the daemon kept the connection open; it sent {data!r}")
    except ConnectionResetError:
        pass  # closed with some of what we sent unread: what it sent came first
    return data, time.monotonic() - t0


def answer(data: bytes) -> tuple[int, dict]:
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)


def test_a_half_sent_request_is_answered_408_and_closed_after_the_header_timeout(
    bounded: Daemon,
) -> None:
    with connect(bounded) as half, connect(bounded) as silent, connect(bounded) as slow:
        half.sendall(HEAD)  # no blank line: the head never ends
        for piece in (HEAD[:10], HEAD[10:30], HEAD[30:] + b"Connection: close\r\n\r\n"):
            slow.sendall(piece)  # a head sent slowly, within the timeout
            time.sleep(0.15)
        data, took = read_until_closed(half)
        status, body = answer(data)
        assert status == 408 and body["error"]["type"] == "header_timeout", body
        assert "--header-timeout" in body["error"]["message"]
        assert took < 3, took
        _, took = read_until_closed(silent)  # connected, sent nothing
        assert took < 2, took
        status, body = answer(read_until_closed(slow)[0])
        assert status == 200 and body["count"] == 0, body


def test_an_idle_kept_alive_connection_and_a_half_sent_second_request_are_closed(
    bounded: Daemon,
) -> None:
    with connect(bounded) as idle, connect(bounded) as second:
        for sock in (idle, second):
            sock.sendall(HEAD + b"\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        second.sendall(HEAD)  # the next request's head, never finished
        _, took = read_until_closed(idle)
        assert took < 3, f"an idle connection lived {took:.1f} s past its answer"
        status, _ = answer(read_until_closed(second)[0])
        assert status == 408


def test_connections_past_the_cap_are_refused_at_once_and_the_daemon_still_answers(
    bounded: Daemon,
) -> None:
    flood = Flood(str(bounded.socket))
    report = flood.run(200, hold_s=0.5)
    assert report["open"] == 20 and report["refused"] == 180, report
    _, body = answer(report["answers"]["503"].encode())
    assert body["error"]["type"] == "too_many_connections"
    assert "--max-connections 20" in body["error"]["message"], body
    # Its 20 connections time out (1 s), and the daemon answers again.
    time.sleep(1.5)
    with bounded.client(timeout=5) as client:
        assert client.get("/v1/datasets").status_code == 200
    log = bounded.log(limit=None)
    assert log.count("refused a connection") == 1, log
    assert "Traceback" not in log
    bounded.stop()  # the count of the burst is told, at the latest when the daemon stops
    assert "179 more like this since the last line: refused a connection" in bounded.log()


def vm_kib(daemon: Daemon, field: str) -> int:
    assert daemon.process is not None
    for line in Path(f"/proc/{daemon.process.pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in the daemon's status")


def test_a_body_announced_over_the_limit_is_refused_before_a_byte_is_read(
    bounded: Daemon,
) -> None:
    for method, path in (("POST", "/v1/datasets"), ("GET", "/v1/datasets")):
        with connect(bounded) as sock:
            sock.sendall(
                f"{method} {path} HTTP/1.1\r\nHost: stager\r\ncontent-type: application/json\r\n"
                "content-length: 400000000\r\n\r\n{".encode()
            )
            data, took = read_until_closed(sock)
        status, body = answer(data)
        assert status == 413, body
        assert body["error"]["type"] == "body_too_large"
        assert "400000000 bytes" in body["error"]["message"]
        assert "--max-body-bytes" in body["error"]["message"]
        assert took < 1, took


def test_a_chunked_body_is_refused_once_past_the_limit_and_memory_stays_flat(
    bounded: Daemon,
) -> None:
    before = vm_kib(bounded, "VmHWM")
    chunk = b'"' + b"x" * (1 << 20) + b'",'  # 1 MiB strings in a JSON list
    sent = 0
    with connect(bounded) as sock:
        sock.sendall(
            b"POST /v1/datasets HTTP/1.1\r\nHost: stager\r\ncontent-type: application/json\r\n"
            b"transfer-encoding: chunked\r\n\r\n" + b"%x\r\n[\r\n" % 1
        )
        try:
            for _ in range(200):  # 200 MiB, if the daemon read it all
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass  # it answered and closed: the rest is never sent
        data, _ = read_until_closed(sock)
    status, body = answer(data)
    assert status == 413 and body["error"]["type"] == "body_too_large", body
    assert "over the daemon's limit of 65536 bytes" in body["error"]["message"]
    assert sent < 64 << 20, f"the daemon read {sent} bytes of a body over its limit"
    grew = vm_kib(bounded, "VmHWM") - before
    assert grew < 32 * 1024, f"the daemon's peak memory grew {grew} KiB"
    with bounded.client(timeout=5) as client:  # a request under the limit is served
        response = client.post("/v1/datasets", json={"name": "x", "steps": []})
        assert response.status_code == 422, response.text
