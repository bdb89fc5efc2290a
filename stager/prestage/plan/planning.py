"""From the queue to the prefetch set: which datasets go to which nodes, as whom.

Pure: the queue as `squeue.parse` read it, the time, the horizon. A job is planned
when it is PENDING, is not root's, declares data, has planned nodes, and starts
within the horizon; every other job gets the reason it was not.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
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


def compute(
    jobs: Iterable[QueuedJob], now: datetime, horizon_s: float, declarations: Declarations
) -> Plan:
    horizon = now + timedelta(seconds=horizon_s)
    by_id, planned, skipped = {}, [], []
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
        first, *others = dict.fromkeys(job.sched_nodes)
        for item in wanted:
            prefetches.add(Prefetch(job.job_id, first, job.uid, job.gid, item))
            prefetches.update(
                Prefetch(job.job_id, node, job.uid, job.gid, item, source=first) for node in others
            )
    return Plan(frozenset(prefetches), planned, skipped, by_id)


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
