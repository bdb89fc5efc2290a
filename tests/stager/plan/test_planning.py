"""The planner's core on synthetic squeue output: parsing Slurm's odd values, which
jobs are planned (and why the others are not), and the diff between intervals."""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta

import httpx
import pytest

from stager.core.settings import Settings
from stager.prestage.plan import squeue
from stager.prestage.plan.changes import diff
from stager.prestage.plan.declared import Declarations, encode, lines
from stager.prestage.plan.planner import Planner
from stager.prestage.plan.planning import compute
from stager.prestage.plan.service import Backoff, Order, Sender, Service, fair_share, orders
from stager.prestage.plan.squeue import RecordedSqueue
from tests.stager.plan.queue import INAT, NOW, row

HORIZON_S = 1800.0


def plan_of(*rows: str):
    jobs, problems = squeue.parse("\n".join(rows))
    assert not problems
    return compute(jobs, NOW, HORIZON_S, Declarations())


def test_a_line_with_slurms_odd_values_parses() -> None:
    jobs, problems = squeue.parse(
        row("7", start="N/A", sched="(null)", declared=None)
        + "\n"
        + row("8", state="RUNNING", sched="(null)", nodes="gpu[01-02,5]")
    )
    assert not problems
    assert jobs[0].start is None and jobs[0].sched_nodes == () and jobs[0].admin_comment is None
    assert jobs[1].job_id == "8" and jobs[1].nodes == ("gpu01", "gpu02", "gpu5")


def test_an_unreadable_line_is_named_and_the_others_are_read() -> None:
    text = row("1") + "\nnot|a|line\n" + row("2", uid="x") + "\n" + row("3_4")  # type: ignore[arg-type]
    jobs, problems = squeue.parse(text)
    assert [job.job_id for job in jobs] == ["1"]
    assert problems[0].startswith("squeue line 2:") and "squeue line 3" in problems[1]
    # JobID is the raw id, a number (an array task's 3_4 is JobArrayID's way): a line
    # that says otherwise is not what the planner asked for.
    assert "squeue line 4: JobID '3_4' is not a job's raw id" in problems[2]


@pytest.mark.parametrize(("field", "value"), [("sched", "n[1-"), ("start", "tomorrow")])
def test_a_field_read_late_that_is_unreadable_skips_its_job_saying_so(field, value) -> None:
    """Starts and hostlists are read only for jobs that get that far (QueuedJob)."""
    plan = plan_of(row("1", declared=[INAT], **{field: value}), row("2", declared=[INAT]))
    assert {p.job_id for p in plan.prefetches} == {"2"}
    assert "cannot read" in plan.skipped[0].reason and value in plan.skipped[0].reason


def test_a_pipe_or_newline_in_a_declaration_cannot_move_the_fields() -> None:
    """The user writes the declaration; uid, gid and nodes must stay Slurm's."""
    hostile = ['x --step \'{"op": "copy", "src": "/a|0|0|PENDING|\\nroot"}\'']
    jobs, _ = squeue.parse(row("9", uid=1001, declared=hostile))
    assert len(jobs) == 1 and jobs[0].uid == 1001 and jobs[0].gid == 1001
    assert lines(jobs[0].admin_comment) == hostile


def test_encoding_round_trips_every_character_the_lua_escapes() -> None:
    words = ["a %41 ; | \t \x01 \x7f b", "c"]
    assert lines(encode(words)) == words
    assert "|" not in encode(words) and "\n" not in encode(words + ["d\ne"])


def test_jobs_in_the_horizon_with_nodes_are_planned_on_each_node_as_their_user() -> None:
    """The first planned node stages from the storage, the others copy from it: the
    storage is read once (docs/prestaging.md, "4-node job")."""
    plan = plan_of(row("10", uid=1001, gid=2000, declared=[INAT]))
    found = {(p.node, p.uid, p.gid, p.job_id, p.wanted.name, p.source) for p in plan.prefetches}
    assert found == {
        ("node1", 1001, 2000, "10", "inat", ""),
        ("node2", 1001, 2000, "10", "inat", "node1"),
    }
    assert plan.prefetches and not plan.skipped


def test_a_multi_node_jobs_orders_are_one_stage_then_copies_from_its_node() -> None:
    plan = plan_of(row("11", uid=1001, declared=[INAT], sched="gpu[03,01-02]"))
    made = orders(diff(frozenset(), plan), lambda node: f"{node}.addr:8766")
    bodies = {o.node: json.loads(o.body) for o in made}
    assert bodies["gpu03"]["action"] == "stage" and "source" not in bodies["gpu03"]
    for node in ("gpu01", "gpu02"):
        assert bodies[node]["action"] == "copy", bodies[node]
        assert (bodies[node]["source"], bodies[node]["source_address"]) == (
            "gpu03",
            "gpu03.addr:8766",
        )
        assert bodies[node]["request"] == bodies["gpu03"]["request"]
    assert [o.copy for o in made].count(True) == 2
    # A plan whose first node moves re-targets the copies to the new source.
    moved = plan_of(row("11", uid=1001, declared=[INAT], sched="gpu[01-02]"))
    changes = diff(plan.prefetches, moved)
    assert {(p.node, p.source) for p in changes.start} == {("gpu01", ""), ("gpu02", "gpu01")}
    assert {p.node for p, _ in changes.cancel} == {"gpu03", "gpu01", "gpu02"}


@pytest.mark.parametrize(
    ("job", "reason"),
    [
        (row("1", uid=0, declared=[INAT]), "root's job"),
        (row("2"), "declares nothing"),
        (row("3", start="N/A", declared=[INAT]), "no planned start"),
        (row("4", start=NOW + timedelta(hours=3), declared=[INAT]), "beyond the horizon"),
        (row("5", sched="(null)", declared=[INAT]), "no planned nodes"),
        (row("6", declared=["inat --recipe r --wait"]), "line 1: --wait says how to stage"),
        (row("7", declared=["Bad --recipe r"]), "must start with the dataset's NAME"),
        (row("8", declared=["x --step 'not json'"]), "is not valid JSON"),
    ],
)
def test_every_job_not_planned_says_why(job: str, reason: str) -> None:
    plan = plan_of(job)
    assert not plan.prefetches
    assert len(plan.skipped) == 1 and reason in plan.skipped[0].reason


def test_running_jobs_are_not_planned() -> None:
    plan = plan_of(row("1", state="RUNNING", nodes="node1", declared=[INAT]))
    assert not plan.prefetches and not plan.skipped and "1" in plan.jobs


def test_the_diff_starts_new_retargets_moved_and_cancels_gone_jobs() -> None:
    first = plan_of(
        row("1", declared=[INAT], sched="node1"),
        row("2", declared=[INAT], sched="node2"),
        row("3", declared=[INAT], sched="node3"),
        row("4", declared=[INAT], sched="node4"),
        row("5", declared=[INAT], sched="node5"),
    )
    assert len(diff(frozenset(), first).start) == 5
    second = plan_of(
        row("1", declared=[INAT], sched="node1"),  # unchanged
        row("2", declared=[INAT], sched="node9"),  # plan moved
        row("3", state="RUNNING", sched="(null)", nodes="node3", declared=[INAT]),  # as planned
        row("4", state="RUNNING", sched="(null)", nodes="node8", declared=[INAT]),  # elsewhere
        row("5", declared=[INAT], sched="node5", start=NOW + timedelta(hours=5)),  # later
        # job 6 was never there; job ... gone: see below
    )
    changes = diff(first.prefetches, second)
    assert [(p.job_id, p.node) for p in changes.start] == [("2", "node9")]
    cancels = {(p.job_id, p.node): why for p, why in changes.cancel}
    assert cancels.keys() == {("2", "node2"), ("4", "node4"), ("5", "node5")}
    assert "moved to node9" in cancels[("2", "node2")]
    assert "started on node8" in cancels[("4", "node4")]
    assert "no longer planned" in cancels[("5", "node5")]
    assert [(p.job_id, p.node) for p in changes.used] == [("3", "node3")]
    assert changes.retargeted == {"2"}
    gone = diff(second.prefetches, plan_of())
    assert {p.job_id for p, why in gone.cancel if "ended or was cancelled" in why} == {"1", "2"}


def test_the_same_declaration_planned_twice_is_the_same_prefetch() -> None:
    """Nothing is restarted between intervals when nothing changed."""
    planner = Planner(RecordedSqueue(row("1", declared=[INAT])), HORIZON_S, clock=lambda: NOW)
    assert len(planner.interval().changes.start) == 2
    again = planner.interval()
    assert not again.changes.start and not again.changes.cancel
    assert planner.source.calls == 2  # one squeue call per interval


def test_a_plan_gone_for_a_cycle_holds_its_prefetches_and_does_not_restart_them() -> None:
    """After a slurmctld restart, SchedNodes and the start are empty until the next
    backfill cycle: nothing is cancelled, and nothing is started again after."""
    planned = row("1", declared=[INAT], sched="node1")
    source = RecordedSqueue(planned)
    planner = Planner(source, HORIZON_S, clock=lambda: NOW)
    assert len(planner.interval().changes.start) == 1
    for unknown in (
        row("1", declared=[INAT], sched="(null)"),
        row("1", declared=[INAT], start="N/A"),
    ):
        source.text = unknown
        gap = planner.interval().changes
        assert not gap.cancel and [p.node for p in gap.held] == ["node1"]
    source.text = planned
    again = planner.interval().changes
    assert not again.start and not again.cancel


def test_one_jobs_declaration_that_breaks_the_parser_skips_that_job_only() -> None:
    """A user writes the lines: a --step nested past json's recursion, or bytes that are
    not UTF-8 in squeue's output, cost that job its pre-staging, not the interval."""
    deep = "x --step '" + "[" * 5000 + "'"
    plan = plan_of(row("1", declared=[deep]), row("2", declared=[INAT]))
    assert {p.job_id for p in plan.prefetches} == {"2"}
    assert [s.job.job_id for s in plan.skipped] == ["1"]
    assert "nested too deep" in plan.skipped[0].reason
    raw = (
        row("3", declared=[INAT]) + "\n"
    ).encode() + b"4|1001|1001|PENDING|N/A|node1||stager1:x \xff|\n"
    jobs, problems = squeue.parse(raw.decode("utf-8", "surrogateescape"))  # as Squeue.read
    assert [job.job_id for job in jobs] == ["3", "4"] and not problems
    plan = compute(jobs, NOW, HORIZON_S, Declarations())
    assert {p.job_id for p in plan.prefetches} == {"3"}


def test_a_declaration_past_ascii_comes_back_as_the_scripts_own_text() -> None:
    """job_submit.lua escapes every byte past ASCII: the planner reads the script's
    UTF-8 back, as the job's own client reads it, so the keys agree."""
    words = ["naïve --recipe r --source /data/日本"]
    assert encode(words).isascii() and lines(encode(words)) == words
    assert "\u2028" not in encode(["a\u2028b"])  # splitlines would cut a line there
    jobs, _ = squeue.parse(row("5", declared=["a --recipe r --source /s\u2028x"]))
    assert lines(jobs[0].admin_comment or "") == ["a --recipe r --source /s\u2028x"]


def test_a_wide_job_is_capped_node_by_node_the_first_node_whole() -> None:
    many = [f"d{i} --recipe inat2021 --source /net/d{i}" for i in range(3)]
    jobs, _ = squeue.parse(row("9", sched="node[1-4]", declared=many))
    plan = compute(jobs, NOW, HORIZON_S, Declarations(), targets_max=5)
    assert sorted((p.node, p.wanted.name, p.source) for p in plan.prefetches) == [
        ("node1", "d0", ""), ("node1", "d1", ""), ("node1", "d2", ""),
        ("node2", "d0", "node1"), ("node2", "d1", "node1"),
    ]  # fmt: skip
    assert plan.capped["9"].startswith("7 of its 12 prefetches (4 nodes x 3 datasets) left out")
    assert not compute(jobs, NOW, HORIZON_S, Declarations(), targets_max=12).capped


def test_an_intervals_share_goes_round_robin_and_the_next_turn_begins_after_it() -> None:
    wanted = {1001: list(range(10_000)), 1002: ["b"], 1003: ["c1", "c2"]}
    assert fair_share(wanted, 5) == [0, "b", "c1", 1, "c2"]
    assert fair_share(wanted, 2, first=1003) == ["c1", 0]  # 1003 first, then 1001
    assert fair_share({1001: [], 1002: ["b"]}, 9) == ["b"]


def test_backoff_doubles_up_to_its_bound_and_forgets_orders_no_longer_wanted() -> None:
    now = [0.0]
    backoff = Backoff(30.0, 100.0, lambda: now[0])
    gaps = []
    for _ in range(5):
        backoff.failed("k")
        gaps.append(backoff.until["k"][0] - now[0])
        assert not backoff.due("k")
        now[0] = backoff.until["k"][0]
        assert backoff.due("k")
    assert gaps == [30.0, 60.0, 100.0, 100.0, 100.0]
    backoff.keep([])
    assert backoff.due("k") and not backoff.until


class AnsweringNodes(Sender):
    """The nodes' answers to the planner's orders, recorded: every order taken, a stage
    on ``staging``'s nodes not ready yet (the port itself: test_plan_service)."""

    def __init__(self) -> None:
        super().__init__(Settings())
        self.sent: list[tuple[str, str]] = []
        self.staging: set[str] = set()
        self.outcome: dict[str, str] = {}  # a node's answer other than "sent"

    async def send(self, order: Order) -> tuple[str, str, bool]:
        action = json.loads(order.body)["action"]
        self.sent.append((action, order.node))
        outcome = self.outcome.get(order.node, "sent")
        return outcome, "", outcome == "sent" and action == "stage" and order.node in self.staging


def test_a_node_whose_new_copy_waits_is_still_cancelled_when_the_job_leaves() -> None:
    """Job 11's first node moves from node1 to node2: node2's stage is staging still, so
    node1's copy from it waits for a later interval. Until that copy is delivered,
    node1's old stage is its to cancel; and node2's stage, delivered, is known. The job
    then leaves the queue: both nodes are told, or their prefetches would hold the
    user's budget and the disk until they expire (6 h)."""
    source = RecordedSqueue(row("11", declared=[INAT], sched="node1,node2"))
    planner = Planner(source, HORIZON_S, clock=lambda: NOW)
    nodes = AnsweringNodes()
    service = Service(planner, nodes)

    async def intervals() -> list[list[tuple[str, str]]]:
        sent = []
        for text, staging in (
            (row("11", declared=[INAT], sched="node1,node2"), set()),
            (row("11", declared=[INAT], sched="node2,node1"), {"node2"}),
            ("", set()),  # the job is cancelled
        ):
            source.text, nodes.staging, nodes.sent = text, staging, []
            await service.interval()
            sent.append(sorted(nodes.sent))
        await nodes.close()
        return sent

    first, moved, left = asyncio.run(intervals())
    assert first == [("copy", "node2"), ("stage", "node1")]
    assert moved == [("stage", "node2")]  # node2's old copy: no cancel beside its stage
    assert left == [("cancel", "node1"), ("cancel", "node2")]


def test_an_order_a_crowded_port_had_no_place_for_is_sent_again_at_once() -> None:
    """A 503 too_many_connections says nothing of the order (strangers may hold the
    port's places): it is sent at the next interval, where a 429 backs off."""
    source = RecordedSqueue(row("12", declared=[INAT], sched="node1")
                            + "\n" + row("13", declared=[INAT], sched="node2"))  # fmt: skip
    nodes = AnsweringNodes()
    nodes.outcome = {"node1": "busy", "node2": "retry"}
    service = Service(Planner(source, HORIZON_S, clock=lambda: NOW), nodes)

    async def intervals() -> list[list[tuple[str, str]]]:
        sent = []
        for _ in range(2):
            nodes.sent = []
            await service.interval()
            sent.append(sorted(nodes.sent))
        await nodes.close()
        return sent

    assert asyncio.run(intervals()) == [
        [("stage", "node1"), ("stage", "node2")],
        [("stage", "node1")],
    ]


def test_the_ports_503_for_want_of_places_is_busy_and_other_answers_as_before() -> None:
    answers = {
        "busy": (503, {"error": {"type": "too_many_connections", "message": "full"}}),
        "retry": (503, {"error": {"type": "shutting_down", "message": "stopping"}}),
        "refused": (403, {"error": {"type": "forbidden", "message": "no"}}),
    }

    async def outcomes() -> dict[str, str]:
        found = {}
        for expected, (code, body) in answers.items():
            sender = Sender(Settings())
            sender._credential = lambda *_: asyncio.sleep(0, "cred")  # type: ignore[method-assign]
            await sender.client.aclose()
            sender.client = httpx.AsyncClient(
                transport=httpx.MockTransport(lambda _, c=code, b=body: httpx.Response(c, json=b))
            )
            order = Order("node1", b"{}", "1", None)
            found[expected] = (await sender.send(order))[0]
            await sender.close()
        return found

    assert asyncio.run(outcomes()) == {k: k for k in answers}
