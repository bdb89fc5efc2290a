"""Preemption: a signal sets a flag; the loop saves at the next step boundary.

SLURM sends SIGUSR1 (``--signal=USR1@120``) or SIGTERM before killing a job.
Saving inside the handler would race with the step in flight (half-updated
weights, a collective in progress), so the handler only records the request;
the training loop asks `requested()` at a step boundary, where all ranks agree
through one tiny all-reduce on the CPU (gloo), saves, and exits with `EXIT_PREEMPTED`.
"""

from __future__ import annotations

import logging
import shutil
import signal
import subprocess

import torch
import torch.distributed as dist

from trainer import distributed as dist_utils

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
# EX_TEMPFAIL from sysexits.h: "try again later"; a wrapper script can tell a
# preempted run (resume it) from a finished (0) or broken (1) one.
EXIT_PREEMPTED = 75


class Preemption:
    def __init__(self) -> None:
        self.flag = False
        self.signum: int | None = None
        self.group: dist.ProcessGroup | None = None  # None: the default group

    def install(self) -> None:
        """Catch the signals; with several ranks, a collective (call it on every rank)."""
        for sig in SIGNALS:
            signal.signal(sig, self._handle)
        if dist_utils.active():
            # Created once: the per-step vote then stays on the CPU and never
            # waits for the GPU, unlike an NCCL all-reduce read with .item().
            self.group = dist_utils.cpu_group()

    def _handle(self, signum: int, frame: object) -> None:
        self.flag = True
        self.signum = signum

    def requested(self) -> bool:
        """True on every rank if any rank got a signal (a collective: call on all ranks)."""
        if not dist_utils.active():
            return self.flag
        t = torch.tensor([1.0 if self.flag else 0.0])
        return bool(dist_utils.all_reduce_max(t, group=self.group).item())


def requeue(job_id: str | None) -> bool:
    """Ask SLURM to requeue this job; True if it accepted."""
    if not job_id:
        return False
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        log.warning("SLURM_JOB_ID is set but scontrol is not on PATH; not requeueing")
        return False
    done = subprocess.run([scontrol, "requeue", job_id], capture_output=True, text=True)
    if done.returncode != 0:
        log.warning("scontrol requeue %s failed: %s", job_id, done.stderr.strip())
        return False
    log.info("requeued SLURM job %s", job_id)
    return True
