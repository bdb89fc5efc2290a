"""Synthetic squeue output in the planner's format (stager.prestage.plan.squeue.FORMAT)."""

from __future__ import annotations

from datetime import datetime, timedelta

from stager.prestage.plan.declared import encode

NOW = datetime(2026, 11, 28, 22, 0, 0)
INAT = "inat --recipe inat2021 --source /net/inat"


def row(
    job_id: str,
    uid: int = 1001,
    state: str = "PENDING",
    start: datetime | str | None = NOW + timedelta(minutes=5),
    sched: str = "node[1-2]",
    nodes: str = "",
    declared: list[str] | None = None,
    gid: int | None = None,
) -> str:
    """One line as `squeue -O JobID:|,...,admin_comment:|` prints it."""
    when = start.isoformat(timespec="seconds") if isinstance(start, datetime) else start or "N/A"
    comment = encode(declared) if declared else "(null)"
    gid = uid if gid is None else gid
    return f"{job_id}|{uid}|{gid}|{state}|{when}|{sched}|{nodes}|{comment}|"
