"""Who runs under whom, from /proc: what tests check about the processes a daemon or a
job step starts (staged work in its own process, nothing outliving its parent)."""

from __future__ import annotations

import contextlib
import os
import tempfile
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


def fork_server_of(daemon_pid: int) -> int | None:
    """The pid of a daemon's multiprocessing fork server, once it runs."""
    for child in children_of(daemon_pid):
        try:
            if b"forkserver" in Path(f"/proc/{child}/cmdline").read_bytes():
                return child
        except OSError:
            continue
    return None


def bound_sockets() -> dict[int, str]:
    """Every Unix socket bound to a path on this machine, by inode (/proc/net/unix)."""
    found = {}
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split(maxsplit=7)  # Num RefCount Protocol Flags Type St Inode Path
        if len(fields) == 8 and fields[7].startswith("/"):
            found[int(fields[6])] = fields[7]
    return found


def socket_paths_of(pid: int) -> list[str]:
    """The paths of the bound Unix sockets process ``pid`` holds open."""
    inodes = set()
    with contextlib.suppress(OSError):  # gone meanwhile
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                link = os.readlink(fd)
                if link.startswith("socket:["):
                    inodes.add(int(link[8:-1]))
    bound = bound_sockets()
    return sorted(bound[inode] for inode in inodes if inode in bound)


# Temp folders that only their process's exit handler removes, or nothing does:
# multiprocessing's (multiprocessing.util.get_temp_dir) and torchrun's logs (without
# --log-dir, torch.distributed.elastic makes one per run and never removes it).
TEMP_GLOBS = ("pymp-*", "torchelastic_*")


def temp_folders() -> set[Path]:
    top = Path(tempfile.gettempdir())
    return {folder for pattern in TEMP_GLOBS for folder in top.glob(pattern)}


def temp_folders_left(before: set[Path]) -> list[str]:
    """Such temp folders made since ``before`` that nothing uses: the exit handler that
    removes one never ran (a process killed -9), or nothing removes it. A folder whose
    socket a live process still holds bound, and this process's own, are not left behind."""
    import multiprocessing

    live = {Path(path).parent for path in bound_sockets().values()}
    own = multiprocessing.current_process()._config.get("tempdir")
    return [
        f"{folder} (a temp folder its process did not remove: see TEMP_GLOBS)"
        for folder in sorted(temp_folders() - before - live)
        if folder.is_dir() and str(folder) != own
    ]
