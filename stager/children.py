"""Staging processes and their workers never outlive the daemon.

A staging process (and the extraction processes it starts) writes into a partial
directory that a restarted daemon resumes in; if the daemon is killed (-9), a
child still writing there would race with the resumed staging.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
from pathlib import Path

from stager.libc import LIBC
from stager.processes import bare_thread

_PR_SET_PDEATHSIG = 1

# What a staging process is called in ps and top (its "comm"); a spare waiting for its
# job (stager.blocking) is called otherwise, so that nobody takes it for a staging.
STAGE_NAME = "stager-stage"
SPARE_NAME = "stager-spare"
# Processes that became a user (stager.rights): a staging's gateway to its sources, and
# a user process doing a request's checks.
GATE_NAME = "stager-gate"
USER_NAME = "stager-user"
WALKER_NAME = "stager-walker"  # the seal's checks of published trees (stager.blocking)


def name_process(name: str) -> None:
    with contextlib.suppress(OSError):  # not Linux: the name is only for people
        Path("/proc/self/comm").write_text(name)


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent (thread) dies."""
    prctl = getattr(LIBC, "prctl", None)
    if prctl is not None:  # not Linux: callers keep their own parent checks
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def die_with(pid: int) -> None:
    """SIGKILL this process when process ``pid`` exits, whoever is its parent.

    A staging process is forked by multiprocessing's fork server, not by the daemon,
    and the server lives on while any staging holds its pipe; so the staging watches
    the daemon itself, through a pidfd, on a thread that only ever waits.
    """
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        os.kill(os.getpid(), signal.SIGKILL)  # gone already
        return
    bare_thread(_die_when_exited, fd)  # no wait for it to run: every staging would pay it


def _die_when_exited(pidfd: int) -> None:
    select.select([pidfd], [], [])  # readable once the process has exited
    os.kill(os.getpid(), signal.SIGKILL)
