"""Pre-staging never holds a job, on the real 4-node SLURM cluster (deploy/slurm/multinode
with ``MN_PRESTAGE=1``: slurmctld doing backfill every 5 s, job_submit.lua, the planner
in the root namespace, node services taking its orders; docs/prestaging.md).

Each test queues a real user's job declaring data (a ``#STAGER`` line) behind root's
blocker on one node (the other nodes busy for longer), so that backfill plans it on
that node and the planner orders a prefetch there; then breaks something. Whatever
breaks, the job starts within a second of its blocker's end (as it does with
pre-staging off: nothing else holds it), is never held (Priority 0) nor requeued, and
stages as it would without pre-staging. Root's jobs and jobs that declare nothing get
no prefetch and no ``--prefer``.

Opt-in (``-m multinode``, root): the 4-node cluster; bench/bench_prestage.py measures
the hits, the fan-out, the wrong plans and the placement on the same cluster.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path

import pytest

from bench import prestage_jobs as pj
from bench.multinode import Cluster, ClusterError, fresh_copy
from tests.deploy.multinode_cluster import module_cluster
from tests.trees import write_tree
from tests.users import User

pytestmark = [pytest.mark.multinode, pytest.mark.slow]

PLANNED = "mn2"  # never the first node: Slurm's own pick for a job with no plan
PLANNED_INDEX = 2
LEAD_S = 30  # how long the job is queued behind its blocker
START_SLACK_S = 1  # Slurm's times are in whole seconds


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    yield from module_cluster(users_jobs=True, prestage=True)


@pytest.fixture(scope="module")
def tree(cluster: Cluster) -> Path:
    tree = write_tree(cluster.storage_dir / "imgs", n_files=60, max_size=200_000)
    for path in [tree, *tree.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return tree


@pytest.fixture
def fresh(cluster: Cluster, tree: Path, request: pytest.FixtureRequest) -> str:
    """A new copy of the tree (a new cache key), as the nodes see it."""
    return cluster.shared(fresh_copy(tree, request.node.name.replace("_", "")[-40:]))


@pytest.fixture(autouse=True)
def healthy(cluster: Cluster) -> Iterator[None]:
    """Each test starts and ends with the planner and every node service running."""
    yield
    cluster.planner("start")
    for index in range(1, len(cluster.nodes) + 1):
        try:
            cluster.node_metrics(index)
        except ClusterError:
            cluster.node_service(index, "start")


def counts(cluster: Cluster) -> dict[str, float]:
    return pj.prefetch_counts(cluster, PLANNED_INDEX)


def queued(
    cluster: Cluster,
    submit: Callable[[], str],
    name: str,
    meanwhile: Callable[[str], None] = lambda job: None,
) -> tuple[pj.Run, float]:
    """Blockers (the planned node's ends LEAD_S from now, the others' much later), then
    the job ``submit`` submits; ``meanwhile(job)`` while it is queued. Its run, and the
    seconds from its blocker's end to its start."""
    blockers = {}
    for node in cluster.nodes:
        limit, sleep = (1, LEAD_S) if node == PLANNED else (60, 3600)
        blockers[node] = pj.blocker(cluster, node, limit, sleep, f"{name}-b-{node}")
    try:
        pj.wait_running(cluster, list(blockers.values()))
        job = submit()
        meanwhile(job)
        run = pj.follow(cluster, job, name)
        ended = cluster.job(blockers[PLANNED])["EndTime"]
    finally:
        pj.cancel(cluster, list(blockers.values()))
    started = run.info["StartTime"]
    late = (datetime.fromisoformat(started) - datetime.fromisoformat(ended)).total_seconds()
    return run, late


def declared(cluster: Cluster, user: User, name: str, source: str) -> Callable[[], str]:
    return lambda: pj.submit_declared(cluster, (user.uid, user.gid), name, source)


def wait_for(what: str, check: Callable[[], bool], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout:.0f} s")
        time.sleep(0.5)


def prefetch_ordered(cluster: Cluster, before: dict[str, float]) -> Callable[[], bool]:
    return lambda: counts(cluster).get("count_started", 0) > before.get("count_started", 0)


def on_time_and_never_held(run: pj.Run, late: float) -> None:
    assert run.ran_on == PLANNED, run.info
    assert late <= START_SLACK_S, (late, run.info)
    assert not pj.held_or_requeued(run), (pj.held_or_requeued(run), run.info)


def test_a_prefetched_job_hits_at_its_start_on_time(
    cluster: Cluster, users: tuple[User, User], interpreter_for_users: str, fresh: str
) -> None:
    """The reference: nothing broken, the job's own staging is a hit."""
    alice = users[0]
    run, late = queued(cluster, declared(cluster, alice, "ok", fresh), "ok")
    on_time_and_never_held(run, late)
    assert run.ok and run.all_hit, (run.hows, run.output)
    assert run.planned == PLANNED


def test_the_planner_killed_after_its_order(
    cluster: Cluster, users: tuple[User, User], interpreter_for_users: str, fresh: str
) -> None:
    alice = users[0]
    before = counts(cluster)

    def kill_planner(job: str) -> None:
        wait_for("prefetch order", prefetch_ordered(cluster, before))
        pid = int((Path(cluster.values["MN_ROOT"]) / "run" / "planner.pid").read_text())
        os.kill(pid, signal.SIGKILL)

    run, late = queued(cluster, declared(cluster, alice, "killed", fresh), "killed", kill_planner)
    on_time_and_never_held(run, late)
    assert run.ok, run.output
    assert cluster.planner("status").startswith("stopped")


def test_the_planned_nodes_service_stopped(
    cluster: Cluster, users: tuple[User, User], interpreter_for_users: str, fresh: str
) -> None:
    """No order can be carried out; the job stages through the daemon its prolog starts
    when the node service does not answer, as without one."""
    alice = users[0]
    cluster.node_service(PLANNED_INDEX, "stop")
    run, late = queued(cluster, declared(cluster, alice, "nosvc", fresh), "nosvc")
    on_time_and_never_held(run, late)
    assert run.ok, run.output
    assert run.hows == ["staged"], run.hows


def test_a_failing_staging(
    cluster: Cluster, users: tuple[User, User], interpreter_for_users: str, tree: Path
) -> None:
    """The declared source does not exist: the prefetch fails on the node (the planner
    logs the node's answer), and the job's own staging fails as it would without
    pre-staging, naming the source."""
    alice = users[0]
    missing = cluster.shared(tree) + "-missing"
    log = Path(cluster.values["MN_ROOT"]) / "log" / "planner.log"
    refusals = log.read_text().count(f"node {PLANNED}: ")

    def prefetch_tried(job: str) -> None:
        # The node answers the order with the staging's error (its checks: no such
        # source), which the planner logs: the prefetch was tried and failed.
        wait_for("refused order", lambda: log.read_text().count(f"node {PLANNED}: ") > refusals)

    run, late = queued(cluster, declared(cluster, alice, "fails", missing), "fails", prefetch_tried)
    on_time_and_never_held(run, late)
    assert not run.ok
    assert "missing" in run.output, run.output


def test_a_slurmctld_restart_while_a_prefetch_runs(
    cluster: Cluster, users: tuple[User, User], interpreter_for_users: str, fresh: str
) -> None:
    """The storage slowed so that the prefetch is still running when slurmctld restarts
    (Slurm forgets its plan until the next backfill cycle; the planner keeps the
    prefetch meanwhile)."""
    alice = users[0]
    before = counts(cluster)
    cluster.set_rate("5mbit")  # the tree's ~6 MB take 10 s

    def restart(job: str) -> None:
        wait_for("prefetch order", prefetch_ordered(cluster, before))
        cluster.restart_slurmctld()

    try:
        run, late = queued(cluster, declared(cluster, alice, "restart", fresh), "restart", restart)
    finally:
        cluster.set_rate(cluster.values["MN_STORAGE_RATE"])
    on_time_and_never_held(run, late)
    assert run.ok, run.output


def test_roots_jobs_and_jobs_declaring_nothing_get_no_prefetch_and_no_prefer(
    cluster: Cluster, users: tuple[User, User], interpreter_for_users: str, fresh: str
) -> None:
    alice = users[0]
    for who, runner, header in [
        ("root", None, pj.declaration("rootdata", fresh)),
        ("nothing", pj.as_user(alice.uid, alice.gid), ""),
    ]:
        before = counts(cluster)
        seen: dict[str, str] = {}

        def submit(who: str = who, runner: list[str] | None = runner, header: str = header) -> str:
            script = 't0=$(date +%s.%N); echo "$t0 $t0 $SLURMD_NODENAME 0" > ' + str(
                cluster.jobs_dir / f"{who}.times"
            )
            return cluster.submit(
                script + "\n", 1, who, extra=["--exclusive", "--time=10"], header=header,
                runner=runner,
            )  # fmt: skip

        def watch(job: str, seen: dict[str, str] = seen) -> None:
            wait_for("a plan", lambda: cluster.job(job).get("SchedNodeList", "(null)") != "(null)")
            seen.update(cluster.job(job))
            time.sleep(3 * int(cluster.values["MN_PLAN_INTERVAL"]))  # the planner's turns

        run, late = queued(cluster, submit, who, watch)
        on_time_and_never_held(run, late)
        assert run.ok, run.output
        assert counts(cluster).get("count_started", 0) == before.get("count_started", 0), who
        assert seen.get("Prefer", "(null)") in ("(null)", ""), (who, seen)
