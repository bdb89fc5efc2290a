"""What an interval would do, and why, in lines for people (``stager plan --dry-run``)."""

from __future__ import annotations

import functools
import pwd
from collections.abc import Iterator

from stager.prestage.plan.planner import Interval
from stager.prestage.plan.planning import Prefetch
from stager.prestage.plan.squeue import QueuedJob


@functools.lru_cache(maxsize=4096)  # one look-up per user: NSS may be LDAP
def user(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _job(job: QueuedJob) -> str:
    start = job.start.isoformat(sep=" ") if job.start else "no planned start"
    return f"job {job.job_id} of {user(job.uid)}, gid {job.gid}, starts {start}"


def _what(prefetch: Prefetch) -> str:
    body = prefetch.wanted.request()
    if body.get("recipe"):
        what = f"recipe {body['recipe']} from {body.get('source', '?')}"
    else:
        what = f"{len(body.get('steps', []))} step(s)"
    image = ", as an image" if body.get("image") else ""
    return f"{prefetch.wanted.name} ({what}{image})"


def lines(interval: Interval) -> Iterator[str]:
    plan, found = interval.plan, interval.changes
    for planned in plan.planned:
        nodes = ",".join(planned.job.sched_nodes)
        names = ", ".join(w.name for w in planned.wanted)
        yield f"plan: {_job(planned.job)} on {nodes}: pre-stage {names}"
    for job_id, why in plan.capped.items():
        yield f"cap: job {job_id}: {why}"
    for prefetch in found.start:
        how = f"copy from {prefetch.source} to" if prefetch.source else "stage on"
        yield f"  would {how} {prefetch.node} as {user(prefetch.uid)}: {_what(prefetch)}"
    for prefetch, why in found.cancel:
        yield f"  would cancel {prefetch.wanted.name} on {prefetch.node}: {why}"
    for skipped in plan.skipped:
        yield f"skip: {_job(skipped.job)}: {skipped.reason}"
    for problem in interval.problems:
        yield f"unread: {problem}"
    pending = sum(1 for job in plan.jobs.values() if job.state == "PENDING")
    yield (
        f"{pending} pending job(s), {len(plan.planned)} planned, {len(found.start)} "
        f"prefetch(es) to start, {len(found.cancel)} to cancel"
    )
