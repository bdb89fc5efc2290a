"""The node service's connections against a hostile user: alice floods the socket
with half-sent requests (tests/flood.py, run as her), and bob and root still get
their answers at once.

The caps are small here (settings) so that each case takes seconds; the service
runs with a low descriptor limit too, so that on code without the caps the flood
takes every descriptor, as 20,000 half-sent requests did with the default limit.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from stager.core.settings import env_name
from tests.daemon import Daemon
from tests.users import User

FLOOD = Path(__file__).resolve().parents[1] / "flood.py"


@pytest.fixture
def node_service(
    users: tuple[User, User], shared_tmp: Path, interpreter_for_users: str
) -> Iterator[Callable[..., Daemon]]:
    started: list[Daemon] = []

    def start(descriptors: int = 1024, **caps: int) -> Daemon:
        env = {env_name(name): str(value) for name, value in caps.items()}
        cache_dir = shared_tmp / f"cache{len(started)}"
        daemon = Daemon(cache_dir=cache_dir, args=["--multi-user"], extra_env=env)
        daemon.wrapper = ["prlimit", f"--nofile={descriptors}:{descriptors}", "--"]
        daemon.runtime_dir.chmod(0o755)
        started.append(daemon)
        return daemon.start()

    yield start
    for daemon in started:
        daemon.stop()
        daemon.cleanup()


class Flooding:
    """``user``'s flood of ``n`` half-sent requests, held ``hold_s`` (tests/flood.py,
    run as that user)."""

    def __init__(self, user: User, daemon: Daemon, n: int, hold_s: float) -> None:
        argv = [sys.executable, str(FLOOD), str(daemon.socket), str(n), str(hold_s)]
        self.process = user.popen(argv)

    def _line(self) -> dict:
        assert self.process.stdout is not None and self.process.stderr is not None
        line = self.process.stdout.readline()
        assert line, f"the flood failed: {self.process.stderr.read()}"
        return json.loads(line)

    def sent(self) -> dict:
        """Once every request is sent: what it holds and what was refused so far."""
        return self._line()

    def held(self) -> dict:
        """At its end: what it held, what was refused."""
        report = self._line()
        self.process.wait(timeout=30)
        return report

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


@pytest.fixture
def floods() -> Iterator[Callable[..., Flooding]]:
    started: list[Flooding] = []

    def start(user: User, daemon: Daemon, n: int, hold_s: float) -> Flooding:
        started.append(Flooding(user, daemon, n, hold_s))
        return started[-1]

    yield start
    for flooding in started:
        flooding.stop()


def timed(user: User, daemon: Daemon, path: str = "/v1/whoami") -> tuple[int, dict, float]:
    """One request, as a client that retries a connection the kernel refused while the
    socket's backlog was full (curl's code 0: no answer) would make it; the time until
    its answer, retries included."""
    t0 = time.monotonic()
    for _ in range(3):
        code, answer = user.curl(daemon.socket, "GET", path)
        if code:
            break
        time.sleep(0.2)
    return code, answer, time.monotonic() - t0


def test_one_users_flood_of_half_sent_requests_leaves_others_and_root_their_answers(
    node_service: Callable[..., Daemon],
    floods: Callable[..., Flooding],
    users: tuple[User, User],
) -> None:
    alice, bob = users
    root = User("root", 0, 0)
    # Without the caps, her half-sent requests take every descriptor of a daemon whose
    # limit is 256: nobody else could connect.
    daemon = node_service(
        descriptors=256,
        max_connections=40,
        max_connections_per_user=10,
        connection_reserve=10,
        header_timeout_s=60,
    )
    hers = floods(alice, daemon, n=2000, hold_s=3)
    for user in (bob, None, root, bob):  # while her 2,000 arrive, then while she holds
        if user is None:
            hers.sent()
            continue
        code, answer, took = timed(user, daemon)
        assert code == 200 and answer["uid"] == user.uid, answer
        # Generous for a loaded test machine: a curl run as that user, in well under
        # a second when it is quiet (bench/bench_fairness.py measures it).
        assert took < 5.0, f"{user.name} waited {took:.2f} s for an answer"
    held = hers.held()
    assert held["sent"] == 2000, held
    assert held["open"] == 10, held  # her cap, held until the header timeout
    assert held["refused"] == 1990, held
    refusal = json.loads(held["answers"]["503"].split("\r\n\r\n", 1)[1])["error"]
    assert refusal["type"] == "too_many_connections"
    assert "--max-connections-per-user 10" in refusal["message"], refusal
    log = daemon.log(limit=None)
    assert "Traceback" not in log
    assert log.count("refused a connection") == 1, log  # once for the burst, not 1,990 times


def test_the_reserve_keeps_places_for_users_who_hold_few_and_root_always_gets_in(
    node_service: Callable[..., Daemon],
    floods: Callable[..., Flooding],
    users: tuple[User, User],
) -> None:
    alice, bob = users
    root = User("root", 0, 0)
    daemon = node_service(
        max_connections=12, max_connections_per_user=10, connection_reserve=4, header_timeout_s=60
    )
    alices = floods(alice, daemon, n=20, hold_s=4)
    alices.sent()
    bobs = floods(bob, daemon, n=6, hold_s=3)
    bobs.sent()
    code, answer, _ = timed(root, daemon)  # the service holds 12 of 12
    assert code == 200 and answer["uid"] == 0, answer
    hers, his = alices.held(), bobs.held()
    # alice stopped at 8: the last 4 places are for users who hold fewer than 4; bob
    # got his 4 there, then the total refused him.
    assert hers["open"] == 8 and hers["refused"] == 12, hers
    assert "--connection-reserve" in hers["answers"]["503"], hers
    assert his["open"] == 4 and his["refused"] == 2, his
    assert "--max-connections 12" in his["answers"]["503"], his
