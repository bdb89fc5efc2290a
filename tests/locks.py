"""Machine-wide locks for what the tests change on the machine itself (its users, the
modes of folders above the interpreter, Debian's packages): `make test` runs two
pytest-xdist workers, and a developer's checkouts may run theirs beside them, so two
processes may change one thing at once. A lock is an ``flock`` on a file in /run: the
kernel drops it when its holder dies, so a killed run never leaves one held.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOCK_DIR = Path("/run/lock") if Path("/run/lock").is_dir() else Path("/tmp")


def lock_path(name: str) -> Path:
    return LOCK_DIR / f"stager-tests-{name}.lock"


@contextmanager
def held(lock: Path) -> Iterator[None]:
    """The lock ``lock`` (a file's path), waited for and held until the block ends."""
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def try_hold(lock: Path) -> int | None:
    """The lock ``lock`` if no live process holds it: its file descriptor (the lock
    lasts until it is closed, or its process ends), else None."""
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def process_key(pid: int) -> str | None:
    """``pid`` and its start time, which name one process for good (a pid alone is
    reused); None when no such process runs."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The fields after the command's name (which may hold spaces): start time is 22nd.
    start = stat.rpartition(")")[2].split()[19]
    return f"{pid}:{start}"


def alive(key: str) -> bool:
    return process_key(int(key.partition(":")[0])) == key
