"""Who runs under whom, from /proc: what tests check about the processes a daemon or a
job step starts (staged work in its own process, nothing outliving its parent)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from stager.core.processes import SPARE_NAME, USER_NAME, WALKER_NAME


def parents() -> dict[int, list[int]]:
    """Every live process's children, by parent pid."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    return children


def children_of(pid: int) -> list[int]:
    return parents().get(pid, [])


def children_since(before: list[int]) -> list[int]:
    """This process's children now that were not among ``before``: what a test started
    and left, not the helpers earlier tests started in the same process (the
    forkserver and resource tracker of a loader made in-process live until it exits)."""
    return [pid for pid in children_of(os.getpid()) if pid not in before]


@contextmanager
def fork_server_stopped_after() -> Iterator[None]:
    """Stops this process's fork server on leaving, if the body started it: an
    in-process ``Processes`` starts one (stager.core.processes), which would otherwise
    live until the test run ends."""
    import multiprocessing.forkserver

    server = multiprocessing.forkserver._forkserver  # one per process (CPython 3.8+)
    running = server._forkserver_pid is not None
    try:
        yield
    finally:
        if not running:
            server._stop()


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, as SLURM's proctrack/linuxproc finds them."""
    children = parents()
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def staging_processes(daemon_pid: int) -> list[int]:
    """A daemon's staging processes: what its multiprocessing fork server forked
    (daemon -> fork server -> staging; not the resource tracker), less a spare waiting
    for its job, the walker and user processes (stager.core.processes), once named."""
    found = []
    for child in children_of(daemon_pid):
        try:
            args = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"forkserver" in args:
            found += [pid for pid in children_of(child) if not is_spare(pid)]
    return found


def is_spare(pid: int) -> bool:
    """A process the fork server keeps that is no staging (a spare, the walker, a user
    process)."""
    return comm(pid) in (SPARE_NAME, WALKER_NAME, USER_NAME)


def comm(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None
