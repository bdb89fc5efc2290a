"""What to do this interval: the prefetch set diffed against the last interval's.

- start: a new prefetch; cancel: one no longer wanted, with why;
- used: its job started on that node, so it is neither cancelled nor tracked any more;
- held: its job is pending with no plan for now (after a slurmctld restart, until its
  next backfill cycle): kept, not cancelled to be started again a cycle later.
A job with both starts and cancels is re-targeted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from stager.prestage.plan.hostlist import HostlistError
from stager.prestage.plan.planning import Plan, Prefetch
from stager.prestage.plan.squeue import QueuedJob


@dataclass
class Changes:
    start: list[Prefetch] = field(default_factory=list)
    cancel: list[tuple[Prefetch, str]] = field(default_factory=list)
    used: list[Prefetch] = field(default_factory=list)
    held: list[Prefetch] = field(default_factory=list)

    @property
    def retargeted(self) -> set[str]:
        return {p.job_id for p in self.start} & {p.job_id for p, _ in self.cancel}


def diff(previous: frozenset[Prefetch], plan: Plan) -> Changes:
    changes = Changes(start=sorted(plan.prefetches - previous))
    for gone in sorted(previous - plan.prefetches):
        job = plan.jobs.get(gone.job_id)
        if job is None:
            changes.cancel.append((gone, f"job {gone.job_id} ended or was cancelled"))
        elif job.state != "PENDING":
            if gone.node in _nodes(job, "nodes"):
                changes.used.append(gone)
            else:
                where = ",".join(_nodes(job, "nodes")) or "other nodes"
                changes.cancel.append((gone, f"job {gone.job_id} started on {where}"))
        elif _plan_unknown(job):
            changes.held.append(gone)
        elif (planned := _nodes(job, "sched_nodes")) and gone.node not in planned:
            moved = ",".join(planned)
            changes.cancel.append((gone, f"job {gone.job_id}'s plan moved to {moved}"))
        else:
            why = "is no longer planned within the horizon"
            changes.cancel.append((gone, f"job {gone.job_id} {why}"))
    return changes


def _nodes(job: QueuedJob, which: str) -> tuple[str, ...]:
    try:
        return getattr(job, which)
    except (ValueError, HostlistError):  # unreadable: as if elsewhere, so it is cancelled
        return ()


def _plan_unknown(job: QueuedJob) -> bool:
    try:
        return job.start is None or not job.sched_nodes
    except (ValueError, HostlistError):
        return False  # unreadable is not unknown: cancelled, as any other doubt
