"""A node gone for good (removed from Slurm, never answering) against a real planner
and a real node service (the harness of test_plan_service): its cancels are dropped
once it has been silent longer than a prefetch lives there, not sent each horizon for
ever and kept in the planner's state."""

from __future__ import annotations

import asyncio
import json
from datetime import datetime, timedelta
from pathlib import Path

from stager.prestage.plan.planner import Planner as Plans
from stager.prestage.plan.service import Service
from stager.prestage.plan.squeue import RecordedSqueue
from tests.daemon import free_privileged_port
from tests.stager.plan.queue import INAT, NOW, row
from tests.stager.plan.test_plan_service import (
    Planner,
    Queue,
    declared,
    eventually,
    has,
    node_service,
)
from tests.stager.plan.test_planning import HORIZON_S, AnsweringNodes
from tests.stager.test_prefetch import munge_socket, private_tree  # noqa: F401 - its munged
from tests.users import User

EXPIRE_S = 3.0  # the planner's STAGER_PREFETCH_EXPIRE_S (6 h in use)
TRIED = "node node3: 1 order(s) not carried out"


def test_a_node_gone_for_good_has_its_cancels_dropped_once_its_prefetches_expired(
    users: tuple[User, User],
    shared_tmp: Path,
    munge_socket: Path,  # noqa: F811
) -> None:
    """alice's prefetch is staged on node3; node3 then goes (stopped for good) and her
    job leaves the queue. The cancel is tried, backing off, until node3 has not
    answered for longer than STAGER_PREFETCH_EXPIRE_S; then it is dropped, said once,
    gone from the kept plan, and never sent again. Before, it was kept and tried once
    per horizon for ever."""
    alice, _ = users
    port = free_privileged_port()
    node3 = node_service(shared_tmp / "node3", munge_socket, "node3", port)
    soon = datetime.now() + timedelta(minutes=5)
    alices = declared(private_tree(alice, shared_tmp / "alice-data"))
    queue = Queue(shared_tmp / "bin")
    queue.set(row("640", uid=alice.uid, gid=alice.gid, start=soon, sched="node3", declared=alices))
    planner = Planner(queue, munge_socket, {"node3": port}, STAGER_PREFETCH_EXPIRE_S=str(EXPIRE_S))
    try:
        eventually(lambda: has(alice, node3, "prefetch-640-mine"), "alice's prefetch on node3")
        node3.stop()
        queue.set()  # her job left; node3 never answers again
        eventually(lambda: TRIED in planner.log(), "the cancel tried at node3")
        dropped = "node node3 has not answered for"
        eventually(lambda: dropped in planner.log(), "node3's cancel dropped", EXPIRE_S + 30)
        kept = json.loads((queue.folder / "plan.json").read_text())
        assert kept["cancels"] == [], kept
        tries, seen = planner.log().count(TRIED), planner.intervals()
        eventually(lambda: planner.intervals() >= seen + 8, "eight intervals more")
        log = planner.log()
        assert log.count(TRIED) == tries, log  # never sent again
        assert log.count(dropped) == 1 and "its 1 cancel(s) are dropped" in log, log
    finally:
        planner.stop()
        node3.stop()
        node3.cleanup()


def test_only_a_silent_nodes_cancels_are_dropped_not_those_of_a_node_that_answers() -> None:
    """Jobs 20 (node1) and 21 (node2) leave once their stages were taken. node1 answers
    each cancel 429 (it is up, and may still hold the prefetch), node2 nothing: past
    prefetch_expire_s only node2's is dropped, and only node1 is asked again."""
    now = [0.0]
    source = RecordedSqueue(row("20", declared=[INAT], sched="node1")
                            + "\n" + row("21", declared=[INAT], sched="node2"))  # fmt: skip
    nodes = AnsweringNodes()
    service = Service(Plans(source, HORIZON_S, clock=lambda: NOW), nodes, clock=lambda: now[0])
    expire_s = nodes.settings.prefetch_expire_s

    async def intervals() -> list[list[tuple[str, str]]]:
        sent = []
        for text, outcome, later in (
            (source.text, {}, 0.0),  # both stages taken
            ("", {"node1": "retry", "node2": "unanswered"}, 1.0),  # the jobs left
            ("", {"node1": "retry", "node2": "unanswered"}, expire_s),
            ("", {"node1": "retry", "node2": "unanswered"}, HORIZON_S),
        ):
            now[0] += later
            source.text, nodes.outcome, nodes.sent = text, outcome, []
            await service.interval()
            sent.append(sorted(nodes.sent))
        await nodes.close()
        return sent

    assert asyncio.run(intervals()) == [
        [("stage", "node1"), ("stage", "node2")],
        [("cancel", "node1"), ("cancel", "node2")],
        [("cancel", "node1"), ("cancel", "node2")],  # node2's last try, then dropped
        [("cancel", "node1")],
    ]
    assert [o.node for o in service.cancels.values()] == ["node1"]
    assert set(service.heard) == {"node1"}
