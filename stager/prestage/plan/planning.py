"""From the queue to the prefetch set: which datasets go to which nodes, as whom.

Pure: the queue as `squeue.parse` read it, the time, the horizon. A job is planned
when it is PENDING, is not root's, declares data, has planned nodes, and starts
within the horizon; every other job gets the reason it was not.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from stager.prestage.plan.declared import Declarations, Wanted
from stager.prestage.plan.hostlist import HostlistError
from stager.prestage.plan.squeue import QueuedJob


@dataclass(frozen=True, order=True)
class Prefetch:
    """Stage ``wanted`` on ``node`` as the job's user (uid, gid) for job ``job_id``: from
    the storage, or (``source``, a multi-node job's first planned node) copied from that
    node once its own prefetch is ready, so that the storage is read once."""

    job_id: str
    node: str
    uid: int
    gid: int
    wanted: Wanted
    source: str = ""  # "": from the storage


@dataclass(frozen=True)
class Planned:
    job: QueuedJob
    wanted: tuple[Wanted, ...]


@dataclass(frozen=True)
class Skipped:
    job: QueuedJob
    reason: str


@dataclass
class Plan:
    prefetches: frozenset[Prefetch]
    planned: list[Planned]
    skipped: list[Skipped]
    jobs: dict[str, QueuedJob]  # every job squeue listed, by id
    # Planned jobs with more prefetch targets than ``targets_max``: what was left out.
    capped: dict[str, str] = field(default_factory=dict)


def compute(
    jobs: Iterable[QueuedJob],
    now: datetime,
    horizon_s: float,
    declarations: Declarations,
    targets_max: int | None = None,
) -> Plan:
    """``targets_max``: the most prefetches (node x dataset) of one job; the rest are
    left out (``Plan.capped`` says which), so that one user's wide job costs the planner,
    its state and the nodes a bounded amount whatever its width."""
    horizon = now + timedelta(seconds=horizon_s)
    by_id, planned, skipped = {}, [], []
    capped: dict[str, str] = {}
    prefetches: set[Prefetch] = set()
    for job in jobs:
        by_id[job.job_id] = job
        if job.state != "PENDING":
            continue  # running: it stages itself; `changes` reads where it went
        try:
            reason = _reason(job, horizon)
        except (ValueError, HostlistError) as exc:  # read only now: see QueuedJob
            reason = f"squeue printed what the planner cannot read: {exc}"
        wanted: tuple[Wanted, ...] = ()
        if reason is None:
            # Parsed only for jobs that get this far: the cost stays with the horizon.
            wanted, reason = declarations.read(job.admin_comment or "")
        if reason is not None:
            skipped.append(Skipped(job, reason))
            continue
        planned.append(Planned(job, wanted))
        # The first planned node reads the storage; the others copy from it, node to
        # node, before the job starts (docs/prestaging.md, "4-node job"): one read.
        # Node by node, the first one whole: a copy needs its source's stage.
        first, *others = nodes = list(dict.fromkeys(job.sched_nodes))
        total = len(nodes) * len(wanted)
        kept = total if targets_max is None else min(total, targets_max)
        for i in range(kept):
            node, item = nodes[i // len(wanted)], wanted[i % len(wanted)]
            source = "" if node == first else first
            prefetches.add(Prefetch(job.job_id, node, job.uid, job.gid, item, source=source))
        if kept < total:
            capped[job.job_id] = (
                f"{total - kept} of its {total} prefetches ({len(nodes)} nodes x "
                f"{len(wanted)} datasets) left out, past {targets_max} a job "
                "(STAGER_PLAN_JOB_TARGETS_MAX): those nodes stage at the job's start"
            )
    return Plan(frozenset(prefetches), planned, skipped, by_id, capped)


def _reason(job: QueuedJob, horizon: datetime) -> str | None:
    if job.uid == 0:
        return "root's job (prefetches run as the job's user; root's never do)"
    if job.admin_comment is None:
        return "declares nothing (no #STAGER line, or job_submit.lua is not installed)"
    if job.start is None:
        return "no planned start yet"
    if job.start > horizon:
        return "starts beyond the horizon"  # (the report prints the start)
    if not job.sched_nodes:
        return "no planned nodes yet (Slurm plans them at its next backfill cycle)"
    return None
