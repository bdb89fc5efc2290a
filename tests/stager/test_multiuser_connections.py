"""The node service's connections against a hostile user: alice floods the socket
with half-sent requests (tests/flood.py, run as her), and bob and root still get
their answers at once.

The caps are small here (settings) so that each case takes seconds; the service
runs with a low descriptor limit too, so that on code without the caps the flood
takes every descriptor, as 20,000 half-sent requests did with the default limit.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.daemon import Daemon
from tests.users import User

FLOOD = Path(__file__).resolve().parents[1] / "flood.py"


@pytest.fixture
def node_service(
    users: tuple[User, User], shared_tmp: Path, interpreter_for_users: str
) -> Iterator[Callable[..., Daemon]]:
    started: list[Daemon] = []

    def start(*caps: str) -> Daemon:
        daemon = Daemon(cache_dir=shared_tmp / f"cache{len(started)}", args=["--multi-user", *caps])
        daemon.runtime_dir.chmod(0o755)
        started.append(daemon)
        return daemon.start()

    yield start
    for daemon in started:
        daemon.stop()
        daemon.cleanup()


def flood(user: User, daemon: Daemon, n: int, hold_s: float) -> Callable[[], dict]:
    """Start ``user``'s flood of ``n`` half-sent requests, held ``hold_s``; returns a
    call that waits for its report."""
    report: dict = {}

    def run() -> None:
        argv = [sys.executable, str(FLOOD), str(daemon.socket), str(n), str(hold_s)]
        done = user.run(argv, timeout=60)
        report.update(json.loads(done.stdout) if done.returncode == 0 else {"error": done.stderr})

    thread = threading.Thread(target=run)
    thread.start()

    def finished() -> dict:
        thread.join()
        return report

    return finished


def timed(user: User, daemon: Daemon, path: str = "/v1/whoami") -> tuple[int, dict, float]:
    t0 = time.monotonic()
    code, answer = user.curl(daemon.socket, "GET", path)
    return code, answer, time.monotonic() - t0


def wait_until(holding: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not holding():
        assert time.monotonic() < deadline, "the flood never got going"
        time.sleep(0.05)


def open_connections(daemon: Daemon) -> int:
    """The service's open Unix socket connections, from its descriptors."""
    assert daemon.process is not None
    fds = Path(f"/proc/{daemon.process.pid}/fd")
    return sum(1 for fd in fds.iterdir() if _is_socket(fd))


def _is_socket(fd: Path) -> bool:
    try:
        return fd.readlink().name.startswith("socket:")
    except OSError:
        return False


def test_one_users_flood_of_half_sent_requests_leaves_others_and_root_their_answers(
    node_service: Callable[..., Daemon], users: tuple[User, User]
) -> None:
    alice, bob = users
    root = User("root", 0, 0)
    daemon = node_service(
        "--max-connections=40",
        "--max-connections-per-user=10",
        "--connection-reserve=10",
        "--header-timeout=60",
    )
    # Without the caps, 300 half-sent requests take every descriptor of a daemon whose
    # limit is 256: nobody else could connect.
    assert daemon.process is not None
    subprocess.run(["prlimit", f"--pid={daemon.process.pid}", "--nofile=256:256"], check=True)
    baseline = open_connections(daemon)
    report = flood(alice, daemon, n=300, hold_s=6)
    wait_until(lambda: open_connections(daemon) >= baseline + 10)
    time.sleep(1.0)  # the rest of her 300 arrive and are refused meanwhile
    for user in (bob, root, bob):
        code, answer, took = timed(user, daemon)
        assert code == 200 and answer["uid"] == user.uid, answer
        assert took < 1.0, f"{user.name} waited {took:.2f} s for an answer"
    held = report()
    assert held["sent"] == 300, held
    assert held["open"] == 10, held  # her cap, held until the header timeout
    assert held["refused"] == 290, held
    refusal = json.loads(held["answers"]["503"].split("\r\n\r\n", 1)[1])["error"]
    assert refusal["type"] == "too_many_connections"
    assert "--max-connections-per-user 10" in refusal["message"], refusal
    log = daemon.log(limit=None)
    assert "Traceback" not in log
    assert log.count("refused a connection") == 1, log  # once for the burst, not 290 times


def test_the_reserve_keeps_places_for_users_who_hold_few_and_root_always_gets_in(
    node_service: Callable[..., Daemon], users: tuple[User, User]
) -> None:
    alice, bob = users
    root = User("root", 0, 0)
    daemon = node_service(
        "--max-connections=12",
        "--max-connections-per-user=10",
        "--connection-reserve=4",
        "--header-timeout=60",
    )
    baseline = open_connections(daemon)
    alices = flood(alice, daemon, n=20, hold_s=8)
    wait_until(lambda: open_connections(daemon) >= baseline + 8)
    bobs = flood(bob, daemon, n=6, hold_s=6)
    time.sleep(1.5)
    code, answer, took = timed(root, daemon)  # the service holds 12 of 12 by now
    assert code == 200 and answer["uid"] == 0, answer
    hers, his = alices(), bobs()
    # alice stopped at 8: the last 4 places are for users who hold fewer than 4; bob
    # got his 4 there, then the total refused him.
    assert hers["open"] == 8 and hers["refused"] == 12, hers
    assert "--connection-reserve" in hers["answers"]["503"], hers
    assert his["open"] == 4 and his["refused"] == 2, his
    assert "--max-connections 12" in his["answers"]["503"], his
