"""The planner's one Slurm call per interval, and its output parsed.

One `squeue` for the whole cluster, never one per job or node: slurmctld answers it
from one job-table read. ``-O admin_comment`` carries each job's declaration (copied
there by job_submit.lua; users cannot change it). Fields are unpadded and followed by
``|``; only AdminComment holds a user's text (``|`` and newlines escaped), and it is
last, so a ``|`` in it could not move the fields before it.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from stager.core.processes import NotRun, Stoppable
from stager.prestage.plan import hostlist

FIELDS = (
    # The raw job id, a number: an array's pending tasks share one record, whose id is
    # a plain number (JobArrayID would print 123_[4-10]); see docs/prestaging.md.
    "JobID",
    "UserID",  # numeric uid
    "GroupID",  # numeric gid
    "State",
    "StartTime",  # planned start while PENDING, actual start once RUNNING
    "SchedNodes",  # the backfill plan's nodes while PENDING; (null) before its first cycle
    "NodeList",  # the nodes a RUNNING job got
    "admin_comment",  # last: see the module's note
)
FORMAT = ",".join(f"{field}:|" for field in FIELDS)
# Pending jobs are planned; the others tell where a pending one started (a job that
# started on its prefetched node, even one already completing, used it).
STATES = "PENDING,CONFIGURING,RUNNING,SUSPENDED,COMPLETING"
NO_TIME = frozenset({"N/A", "Unknown", "None", "(null)", ""})
NO_TEXT = frozenset({"", "(null)"})


class SqueueError(RuntimeError):
    """squeue could not be run, or printed what the planner cannot read."""


@dataclass(eq=False)  # not frozen: its __init__ would cost a third of a line's parse
class QueuedJob:
    """One squeue line; the start and the hostlists, most of a line's cost, are read
    when first asked for (most of a large queue is skipped before)."""

    job_id: str
    uid: int
    gid: int
    state: str
    start_text: str
    sched_text: str
    nodes_text: str
    admin_comment: str | None

    @functools.cached_property
    def start(self) -> datetime | None:
        """Planned start while PENDING; controller's local time, as squeue prints it."""
        text = self.start_text.strip()
        return None if text in NO_TIME else datetime.fromisoformat(text)

    @functools.cached_property
    def sched_nodes(self) -> tuple[str, ...]:
        return hostlist.expand(self.sched_text)

    @functools.cached_property
    def nodes(self) -> tuple[str, ...]:
        return hostlist.expand(self.nodes_text)

    def check(self) -> None:
        """Read every field now: raises ValueError / HostlistError naming the bad one."""
        _ = self.start, self.sched_nodes, self.nodes


def command(squeue: str = "squeue") -> list[str]:
    # --all: hidden partitions too; --noheader: data lines only.
    return [squeue, "--all", "--noheader", f"--states={STATES}", "-O", FORMAT]


def parse(
    text: str, known: dict[str, QueuedJob] | None = None
) -> tuple[list[QueuedJob], list[str]]:
    """The jobs, and a sentence for each line that could not be read. ``known``: the
    last interval's lines, reused as read, refilled with this interval's."""
    jobs, problems = [], []
    last = dict(known or {})
    if known is not None:
        known.clear()
    # Lines end at "\n" only: splitlines would also cut a job's comment at U+2028 or \x1c.
    for number, line in enumerate(text.split("\n"), start=1):
        job = last.get(line)
        if job is None:
            if not line.strip():
                continue
            try:
                job = parse_line(line)
            except (ValueError, hostlist.HostlistError) as exc:
                problems.append(f"squeue line {number}: {exc}")
                continue
        jobs.append(job)
        if known is not None:
            known[line] = job
    return jobs, problems


def parse_line(line: str) -> QueuedJob:
    # ":|" prints no padding: the fields need no strip.
    parts = line.split("|", len(FIELDS) - 1)
    if len(parts) != len(FIELDS):
        raise ValueError(f"{len(parts)} fields where {len(FIELDS)} were asked for: {line!r}")
    job_id, uid, gid, state, start, sched, nodes, comment = parts
    if not job_id.isdigit():
        raise ValueError(f"JobID {job_id!r} is not a job's raw id (a number)")
    comment = comment[:-1] if comment.endswith("|") else comment  # its own separator
    comment = None if comment in NO_TEXT else comment
    return QueuedJob(job_id, int(uid), int(gid), state, start, sched, nodes, comment)


class Squeue:
    """Runs the call and counts it: the benchmark and tests hold the planner to one per
    interval. ``output``: read this text instead (``--squeue-output``, tests)."""

    def __init__(self, argv: Sequence[str] | None = None, timeout_s: float = 30.0) -> None:
        self.argv = list(argv or command())
        self.timeout_s = timeout_s
        self.calls = 0
        self.last_s = 0.0  # the last call's time (the service's log line)
        self._call = Stoppable()  # the call under way, for stop()

    def read(self) -> str:
        self.calls += 1
        started = time.perf_counter()
        try:
            # One job's bytes that are not UTF-8 must not stop every job's interval: run
            # keeps them as surrogates.
            done = self._call.run(self.argv, self.timeout_s)
        except NotRun as exc:
            if exc.timed_out:
                raise SqueueError(f"{exc}; slurmctld is busy or down") from exc
            raise SqueueError(
                f"{exc}; run the planner on a host with Slurm's client commands (the controller)"
            ) from exc
        finally:
            self.last_s = time.perf_counter() - started
        if done.returncode != 0:
            raise SqueueError(f"squeue exited {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def stop(self) -> None:
        """Kill a call under way (from another thread: the service stopping, which must
        not wait for a slurmctld that does not answer)."""
        self._call.kill()


class RecordedSqueue(Squeue):
    """squeue's output recorded: a text (tests, the benchmark), or a file read again at
    each call (``--squeue-output``: tests, and trying the planner on a recorded queue)."""

    def __init__(self, text: str | Path) -> None:
        super().__init__(argv=["(recorded)"])
        self.text = text  # the output, or the file that holds it

    def read(self) -> str:
        self.calls += 1
        if isinstance(self.text, str):
            return self.text
        try:
            return self.text.read_text()
        except OSError as exc:
            raise SqueueError(f"--squeue-output {self.text}: {exc.strerror}") from exc
