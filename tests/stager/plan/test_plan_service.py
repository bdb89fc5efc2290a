"""`stager plan` as a service against real node services: each a `stager serve
--multi-user` as root with its prefetch port on 127.0.0.1 and a node name of its own,
one real munged for all (as a cluster's), real users (tests/users.py), and squeue a
program on PATH printing the file the test rewrites between intervals."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from tests.daemon import Daemon, free_privileged_port
from tests.stager.plan.queue import row
from tests.stager.test_prefetch import munge_socket, private_tree  # noqa: F401 - its munged
from tests.users import User

INTERVAL_S = 0.5


def node_service(
    cache: Path, munge: Path, node: str, port: int, wait: bool = True, **env: str
) -> Daemon:
    """``wait=False``: started, not yet ready (``wait_ready``): two start side by side."""
    daemon = Daemon(
        cache_dir=cache,
        args=["--multi-user", "--prefetch-listen", f"127.0.0.1:{port}"],
        extra_env={"STAGER_MUNGE_SOCKET": str(munge), "STAGER_NODE_NAME": node, **env},
    )
    daemon.runtime_dir.chmod(0o755)
    return daemon.start(wait=wait)


class Queue:
    """A fake ``squeue`` first on PATH: prints ``queue.txt``, counting its calls."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir()
        self.folder = folder
        self.text, self.calls = folder / "queue.txt", folder / "calls"
        program = folder / "squeue"
        program.write_text(f"#!/bin/sh\necho x >> {self.calls}\ncat {self.text}\n")
        program.chmod(0o755)
        self.set()

    def set(self, *rows: str) -> None:
        part = self.text.with_suffix(".part")
        part.write_text("".join(f"{r}\n" for r in rows))
        part.rename(self.text)

    def count(self) -> int:
        return len(self.calls.read_text().splitlines()) if self.calls.exists() else 0


class Planner:
    def __init__(self, queue: Queue, munge: Path, addresses: dict[str, int], **more: str) -> None:
        self.log_path = queue.folder / "planner.log"
        env = dict(
            os.environ,
            **more,
            PATH=f"{queue.folder}:{os.environ['PATH']}",
            STAGER_MUNGE_SOCKET=str(munge),
            STAGER_PLAN_NODE_ADDRESSES=",".join(f"{n}=127.0.0.1:{p}" for n, p in addresses.items()),
            STAGER_PLAN_STATE=str(queue.folder / "plan.json"),
        )
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "stager", "plan", "--plan-interval", str(INTERVAL_S)],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def log(self) -> str:
        return self.log_path.read_text()

    def intervals(self) -> int:
        return self.log().count("stager plan: interval: ")

    def interval_lines(self) -> list[str]:
        return [line for line in self.log().splitlines() if "stager plan: interval: " in line]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


def eventually(check: Callable[[], object], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout:g} s: {what}"
        time.sleep(0.1)


def status(user: User, node: Daemon, name: str) -> tuple[int, dict]:
    return user.curl(node.socket, "GET", f"/v1/datasets/{name}")


def has(user: User, node: Daemon, name: str) -> bool:
    code, answer = status(user, node, name)
    return code == 200 and answer["state"] == "ready" and answer["owner"] == user.uid


def gone(user: User, node: Daemon, name: str) -> bool:
    return status(user, node, name)[0] == 404


def declared(tree: Path) -> list[str]:
    return [f"mine --step '{json.dumps({'op': 'copy', 'src': str(tree)})}'"]


@pytest.fixture
def nodes(shared_tmp: Path, munge_socket: Path) -> Iterator[dict[str, Daemon | int]]:  # noqa: F811
    """node1 and node2 running; node3's port given to the planner, nobody on it yet."""
    ports = {name: free_privileged_port() for name in ("node1", "node2", "node3")}
    started: list[Daemon] = []
    try:
        for name in ("node1", "node2"):
            started.append(node_service(shared_tmp / name, munge_socket, name, ports[name], False))
        for daemon in started:
            daemon.wait_ready()
        yield {"node1": started[0], "node2": started[1], "ports": ports}  # type: ignore[dict-item]
    finally:
        for daemon in started:
            daemon.stop()
            daemon.cleanup()


def test_the_service_stages_retargets_cancels_and_retries_a_node_that_was_down(
    nodes: dict,
    users: tuple[User, User],
    shared_tmp: Path,
    munge_socket: Path,  # noqa: F811
) -> None:
    alice, bob = users
    node1, node2, ports = nodes["node1"], nodes["node2"], nodes["ports"]
    soon = datetime.now() + timedelta(minutes=5)
    alices = declared(private_tree(alice, shared_tmp / "alice-data"))
    bobs = declared(private_tree(bob, shared_tmp / "bob-data"))
    job = {"uid": alice.uid, "gid": alice.gid, "start": soon, "declared": alices}
    on_node3 = row("601", uid=bob.uid, gid=bob.gid, start=soon, sched="node3", declared=bobs)
    queue = Queue(shared_tmp / "bin")
    queue.set(row("600", sched="node1", **job), on_node3)
    planner = Planner(queue, munge_socket, ports)
    node3 = None
    try:
        # Staged as alice on node1, though node3 does not answer.
        eventually(lambda: has(alice, node1, "prefetch-600-mine"), "alice's prefetch on node1")
        eventually(lambda: "node node3: 1 order(s) not carried out" in planner.log(), "node3")
        assert gone(alice, node2, "prefetch-600-mine")

        # node3 comes up: its order is sent again, and staged as bob.
        node3 = node_service(shared_tmp / "node3", munge_socket, "node3", ports["node3"])
        eventually(lambda: has(bob, node3, "prefetch-601-mine"), "bob's prefetch on node3")

        # The plan moves to node2: cancelled on node1 (counted as wasted), started there.
        queue.set(row("600", sched="node2", **job), on_node3)
        eventually(lambda: has(alice, node2, "prefetch-600-mine"), "re-targeted to node2")
        eventually(lambda: gone(alice, node1, "prefetch-600-mine"), "cancelled on node1")
        with node1.client() as client:
            assert 'stager_prefetches_total{outcome="wasted"} 1.0' in client.get("/metrics").text

        # The job is gone (cancelled or ended): cancelled where it was.
        queue.set(on_node3)
        eventually(lambda: gone(alice, node2, "prefetch-600-mine"), "cancelled on node2")
        assert has(bob, node3, "prefetch-601-mine")

        # One squeue call per interval, whatever happened in it.
        seen = planner.intervals()
        assert abs(queue.count() - seen) <= 1, (queue.count(), seen)
        assert "orders sent" in planner.log() and "squeue " in planner.log()
        # The planner's own lines, not one of httpx's per order sent.
        assert "HTTP Request:" not in planner.log(), planner.log()

        # SIGTERM: stopped at once, exit 0.
        began = time.monotonic()
        planner.process.send_signal(signal.SIGTERM)
        assert planner.process.wait(5) == 0, planner.log()
        # well under an interval (30 s): it does not finish the interval first; the
        # bound is loose because a loaded CI machine slows the interpreter's exit
        assert time.monotonic() - began < 5.0
    finally:
        planner.stop()
        if node3 is not None:
            node3.stop()
            node3.cleanup()


def test_a_two_node_jobs_second_node_copies_from_the_first_once_it_took_its_order(
    nodes: dict,
    users: tuple[User, User],
    shared_tmp: Path,
    munge_socket: Path,  # noqa: F811
) -> None:
    """Planned on node3 (first) and node2: node3 stages from the storage, node2 copies
    from node3. While node3 is down, node2 is not sent a copy that could only fail."""
    alice, _ = users
    node2, ports = nodes["node2"], nodes["ports"]
    soon = datetime.now() + timedelta(minutes=5)
    alices = declared(private_tree(alice, shared_tmp / "alice-data"))
    queue = Queue(shared_tmp / "bin")
    queue.set(row("700", uid=alice.uid, gid=alice.gid, start=soon, sched="node3,node2",
                  declared=alices))  # fmt: skip
    planner = Planner(queue, munge_socket, ports)
    node3 = None
    try:
        eventually(lambda: planner.intervals() >= 3, "three intervals")
        assert "node node3: 1 order(s) not carried out" in planner.log()
        assert "node node2" not in planner.log()  # its copy waits for node3
        assert gone(alice, node2, "prefetch-700-mine")

        node3 = node_service(shared_tmp / "node3", munge_socket, "node3", ports["node3"])
        eventually(lambda: has(alice, node3, "prefetch-700-mine"), "staged on node3")
        eventually(lambda: has(alice, node2, "prefetch-700-mine"), "copied to node2")
        code, copied = status(alice, node2, "prefetch-700-mine")
        assert (copied["origin"]["how"], copied["origin"]["node"]) == ("broadcast", "node3")
        with node2.client() as client:
            assert "stager_source_read_bytes_total 0.0" in client.get("/metrics").text
    finally:
        planner.stop()
        if node3 is not None:
            node3.stop()
            node3.cleanup()


def test_a_node_that_goes_from_copying_to_staging_keeps_its_prefetch(
    nodes: dict,
    users: tuple[User, User],
    shared_tmp: Path,
    munge_socket: Path,  # noqa: F811
) -> None:
    """Planned on node1 (first) and node2, then on node2 (first) and node1: node2 gets a
    stage for the job and node1 a copy from node2. The old prefetches' cancels must not
    reach those same nodes with them: a cancel taken after node2's stage dropped the
    data it had just kept, and node1's copy from node2 then found nothing."""
    alice, _ = users
    node1, node2 = nodes["node1"], nodes["node2"]
    soon = datetime.now() + timedelta(minutes=5)
    alices = declared(private_tree(alice, shared_tmp / "alice-data"))
    queue = Queue(shared_tmp / "bin")
    job = {"uid": alice.uid, "gid": alice.gid, "start": soon, "declared": alices}
    queue.set(row("720", sched="node1,node2", **job))
    planner = Planner(queue, munge_socket, nodes["ports"])
    try:
        eventually(lambda: has(alice, node2, "prefetch-720-mine"), "copied to node2")
        queue.set(row("720", sched="node2,node1", **job))
        seen = planner.intervals()
        eventually(lambda: planner.intervals() >= seen + 4, "four intervals on the new plan")
        assert has(alice, node2, "prefetch-720-mine"), status(alice, node2, "prefetch-720-mine")
        eventually(lambda: has(alice, node1, "prefetch-720-mine"), "node1 has it still")
    finally:
        planner.stop()


def test_once_runs_one_interval_and_only_as_root_or_slurmuser(
    users: tuple[User, User],
    shared_tmp: Path,
    munge_socket: Path,  # noqa: F811
    interpreter_for_users: str,
) -> None:
    alice, _ = users
    soon = datetime.now() + timedelta(minutes=5)
    recorded = shared_tmp / "queue.txt"
    inat = ["x --recipe inat2021 --source /net/inat"]
    recorded.write_text(row("700", uid=alice.uid, start=soon, sched="node9", declared=inat) + "\n")
    recorded.chmod(0o644)
    argv = [sys.executable, "-m", "stager", "plan", "--once", "--squeue-output", str(recorded)]
    port = free_privileged_port()  # nobody listens: the one order is not carried out
    env = {
        "STAGER_MUNGE_SOCKET": str(munge_socket),
        "STAGER_PLAN_NODE_PORT": str(port),
        "STAGER_PLAN_STATE": str(shared_tmp / "plan.json"),
    }
    done = subprocess.run(argv, env=os.environ | env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert "node node9: 1 order(s) not carried out" in done.stderr
    assert "1 jobs seen (1 pending), 1 planned, orders sent 0, failed 1" in done.stderr

    refused = alice.run(argv, env=env)
    assert refused.returncode == 2, refused.stderr
    assert "runs as root or SlurmUser" in refused.stderr
    assert "node services would refuse its credentials" in refused.stderr


def test_a_restarted_planner_cancels_what_it_ordered_for_jobs_that_left_meanwhile(
    nodes: dict,
    users: tuple[User, User],
    shared_tmp: Path,
    munge_socket: Path,  # noqa: F811
) -> None:
    alice, _ = users
    node1, ports = nodes["node1"], nodes["ports"]
    soon = datetime.now() + timedelta(minutes=5)
    alices = declared(private_tree(alice, shared_tmp / "alice-data"))
    queue = Queue(shared_tmp / "bin")
    queue.set(row("610", uid=alice.uid, gid=alice.gid, start=soon, sched="node1", declared=alices))
    planner = Planner(queue, munge_socket, ports)
    try:
        eventually(lambda: has(alice, node1, "prefetch-610-mine"), "alice's prefetch on node1")
        eventually(lambda: (queue.folder / "plan.json").exists(), "the plan kept")
        planner.process.kill()  # no chance to do anything more
        planner.process.wait(10)
        queue.set()  # the job is cancelled while the planner is down
        planner = Planner(queue, munge_socket, ports)
        eventually(lambda: gone(alice, node1, "prefetch-610-mine"), "cancelled after a restart")
        eventually(lambda: "the last plan: 1 prefetches, 0 cancels" in planner.log(), "its log")
        saved = json.loads((queue.folder / "plan.json").read_text())
        eventually(
            lambda: json.loads((queue.folder / "plan.json").read_text())["prefetches"] == [],
            "the kept plan emptied",
        )
        assert (queue.folder / "plan.json").stat().st_mode & 0o777 == 0o600, saved
    finally:
        planner.stop()


def test_sigterm_stops_it_at_once_while_squeue_does_not_answer(
    shared_tmp: Path,
    munge_socket: Path,  # noqa: F811
) -> None:
    """slurmctld down: squeue waits for it (9 s here, until its timeout at worst). The
    planner still stops at once: the call is killed, not waited for."""
    queue = Queue(shared_tmp / "bin")
    program = queue.folder / "squeue"
    program.write_text(f"#!/bin/sh\necho x >> {queue.calls}\nexec sleep 60\n")
    planner = Planner(queue, munge_socket, {})
    try:
        eventually(lambda: queue.count() == 1, "squeue called")
        began = time.monotonic()
        planner.process.send_signal(signal.SIGTERM)
        assert planner.process.wait(5) == 0, planner.log()
        # squeue would answer in 60 s: well under that, it was killed, not waited for
        # (the bound is loose because a loaded machine slows the interpreter's exit:
        # 1.4 s at a load of 13 on 2 cores)
        assert time.monotonic() - began < 5.0
    finally:
        planner.stop()


def metric(node: Daemon, label: str) -> float:
    with node.client() as client:
        text = client.get("/metrics").text
    line = next((x for x in text.splitlines() if x.startswith(label + " ")), f"{label} 0")
    return float(line.split()[-1])


def test_one_users_wide_job_takes_a_bounded_share_of_an_interval_and_of_the_plan(
    nodes: dict,
    users: tuple[User, User],
    shared_tmp: Path,
    munge_socket: Path,  # noqa: F811
) -> None:
    """3 orders an interval, 4 prefetches a job. alice's job declares 6 datasets: 4 are
    ordered (the 2 left out logged once), over two intervals, round-robin with bob's one,
    which goes in the first."""
    alice, bob = users
    node1, ports = nodes["node1"], nodes["ports"]
    soon = datetime.now() + timedelta(minutes=5)
    trees = [private_tree(alice, shared_tmp / f"alice-{i}", n_files=1) for i in range(6)]
    alices = [
        f"d{i} --step '{json.dumps({'op': 'copy', 'src': str(t)})}'" for i, t in enumerate(trees)
    ]
    bobs = declared(private_tree(bob, shared_tmp / "bob-data", n_files=1))
    queue = Queue(shared_tmp / "bin")
    queue.set(
        row("700", uid=alice.uid, gid=alice.gid, start=soon, sched="node1", declared=alices),
        row("701", uid=bob.uid, gid=bob.gid, start=soon, sched="node1", declared=bobs),
    )
    more = {"STAGER_PLAN_ORDERS_PER_INTERVAL": "3", "STAGER_PLAN_JOB_TARGETS_MAX": "4"}
    planner = Planner(queue, munge_socket, ports, **more)
    try:
        eventually(lambda: planner.intervals() >= 4, "four intervals")
        first, second, *rest = planner.interval_lines()
        assert "orders sent 3, failed 0, waiting 2" in first, planner.log()
        assert "orders sent 2, failed 0, waiting 0" in second, planner.log()
        assert all("orders sent 0, failed 0, waiting 0" in line for line in rest), rest
        eventually(lambda: has(bob, node1, "prefetch-701-mine"), "bob's prefetch")
        for i in range(4):
            eventually(lambda i=i: has(alice, node1, f"prefetch-700-d{i}"), f"alice's d{i}")
        for i in (4, 5):
            assert gone(alice, node1, f"prefetch-700-d{i}")
        left_out = "job 700: 2 of its 6 prefetches (1 nodes x 6 datasets) left out, past 4"
        assert planner.log().count(left_out) == 1, planner.log()
        kept = json.loads((queue.folder / "plan.json").read_text())["prefetches"]
        assert len(kept) == 5, kept
    finally:
        planner.stop()


def test_an_order_the_node_refuses_for_now_is_sent_again_less_and_less_often(
    users: tuple[User, User],
    shared_tmp: Path,
    munge_socket: Path,  # noqa: F811
) -> None:
    """node1 refuses alice's prefetch 429 (past her budget there, 1 byte): each try costs
    a munge, the node's unmunge and two fsync'd saves. Over 12 intervals of 0.5 s the
    planner tries at 0, 0.5, 1.5, 3.5 s (doubling, up to the horizon), not 12 times
    (the old code: 12)."""
    alice, _ = users
    port = free_privileged_port()
    node1 = node_service(
        shared_tmp / "node1", munge_socket, "node1", port, STAGER_PREFETCH_USER_BUDGET_BYTES="1"
    )
    soon = datetime.now() + timedelta(minutes=5)
    alices = declared(private_tree(alice, shared_tmp / "alice-data"))
    queue = Queue(shared_tmp / "bin")
    queue.set(row("620", uid=alice.uid, gid=alice.gid, start=soon, sched="node1", declared=alices))
    began = time.monotonic()
    planner = Planner(queue, munge_socket, {"node1": port})
    try:
        eventually(lambda: planner.intervals() >= 12, "twelve intervals")
        refused = metric(node1, 'stager_prefetches_total{outcome="refused"}')
        # Gaps of 0.5, 1, 2, 4 s...: in T seconds at most 2 + log2(T / 0.5) tries (5 in
        # the 6 s that 12 intervals take unloaded), wherever a slow machine stretched them.
        most = 2 + math.log2((time.monotonic() - began) / INTERVAL_S)
        assert 2 <= refused <= most < 12, (refused, most, planner.log())
        assert "429" in planner.log() and "past the user's budget" in planner.log()
        assert gone(alice, node1, "prefetch-620-mine")
    finally:
        planner.stop()
        node1.stop()
        node1.cleanup()
