"""The stager daemons running on this node, found by their processes: for ``stager
stop`` to name the one a user most likely means when none runs for the runtime folder
it looked in (one started with ``--runtime-dir``, or the node service).

A daemon is a process whose command line is ``stager serve`` (the console script or
``python -m stager``), without ``--detach`` (that one is the launcher, gone once the
daemon answers). Its socket is read from its open descriptors, which the kernel shows
only to the process's own user and root; for another user's process (the node
service, root's) only its command line is known.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True)
class Daemon:
    pid: int
    uid: int
    argv: tuple[str, ...]
    sockets: tuple[Path, ...]  # the Unix sockets it listens on, where they can be read

    @property
    def command(self) -> str:
        return " ".join(self.argv)


def running(exclude: int | None = None) -> list[Daemon]:
    """Every stager daemon on the node, by pid."""
    found = []
    listening = _listening_unix_sockets()
    for entry in PROC.iterdir():
        if not entry.name.isdigit() or int(entry.name) == exclude:
            continue
        try:
            argv = tuple((entry / "cmdline").read_bytes().decode(errors="replace").split("\0"))
            uid = entry.stat().st_uid
        except OSError:
            continue  # gone meanwhile
        if is_daemon(argv[:-1] if argv and argv[-1] == "" else argv):
            sockets = _sockets_of(entry, listening)
            found.append(Daemon(int(entry.name), uid, tuple(a for a in argv if a), sockets))
    return sorted(found, key=lambda d: d.pid)


def is_daemon(argv: tuple[str, ...]) -> bool:
    """Whether ``argv`` is ``stager serve`` without ``--detach``."""
    for at, arg in enumerate(argv[:4]):
        by_module = arg == "-m" and argv[at + 1 : at + 2] == ("stager",)
        if by_module or os.path.basename(arg) == "stager":
            rest = argv[at + (2 if by_module else 1) :]
            return rest[:1] == ("serve",) and "--detach" not in rest
    return False


def _listening_unix_sockets() -> dict[str, Path]:
    """Socket inode -> path of every listening Unix socket with a path."""
    found: dict[str, Path] = {}
    try:
        lines = (PROC / "net" / "unix").read_text().splitlines()[1:]
    except OSError:
        return found
    for line in lines:
        fields = line.split()
        # Num RefCount Protocol Flags Type St Inode [Path]; flag 0x10000: listening
        if len(fields) >= 8 and int(fields[3], 16) & 0x10000 and fields[7].startswith("/"):
            found[fields[6]] = Path(fields[7])
    return found


def _sockets_of(entry: Path, listening: dict[str, Path]) -> tuple[Path, ...]:
    sockets = []
    try:
        for fd in (entry / "fd").iterdir():
            target = os.readlink(fd)
            if target.startswith("socket:[") and target[8:-1] in listening:
                sockets.append(listening[target[8:-1]])
    except OSError:
        pass  # another user's process: its descriptors are not ours to read
    return tuple(sorted(set(sockets)))
