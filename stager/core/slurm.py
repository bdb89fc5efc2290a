"""Ask SLURM whether a job still exists, so leases of finished jobs can be dropped."""

from __future__ import annotations

from stager.core.processes import NotRun, run

# Every state in which a job may still read its data.
ALIVE_STATES = frozenset(
    {
        "PENDING",
        "RUNNING",
        "SUSPENDED",
        "CONFIGURING",
        "COMPLETING",
        "REQUEUED",
        "REQUEUE_HOLD",
        "REQUEUE_FED",
        "RESIZING",
        "SIGNALING",
        "STAGE_OUT",
        "STOPPED",
    }
)


def job_alive(job_id: str, timeout_s: float = 10.0) -> bool | None:
    """True/False when SLURM answers; None when it cannot be asked (keep the lease)."""
    try:
        result = run(["scontrol", "show", "job", "--oneliner", job_id], timeout_s)
    except NotRun:  # not installed, or no answer
        return None
    if result.returncode != 0:
        # Purged from slurmctld's memory: long finished. Anything else: cannot tell.
        return False if "Invalid job id" in result.stderr else None
    for field in result.stdout.split():
        if field.startswith("JobState="):
            return field.removeprefix("JobState=") in ALIVE_STATES
    return None
