"""The stager daemons on this node, found by their processes: for ``stager stop`` to
name the one a user most likely means when none runs for the runtime folder it looked in.

A daemon is a process whose command line is ``stager serve`` without ``--detach``
(the launcher). Its socket is read from its open descriptors, which the kernel shows
only to its own user and root.
"""

from __future__ import annotations

import os
import stat
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
        daemon = _daemon_at(entry, listening)
        if daemon is not None:
            found.append(daemon)
    return sorted(found, key=lambda d: d.pid)


def daemon(pid: int) -> Daemon | None:
    """The stager daemon whose pid is ``pid``, or None if that process is none."""
    return _daemon_at(PROC / str(pid), _listening_unix_sockets())


def _daemon_at(entry: Path, listening: dict[str, list[Path]]) -> Daemon | None:
    try:
        argv = tuple((entry / "cmdline").read_bytes().decode(errors="replace").split("\0"))
        uid = entry.stat().st_uid
    except OSError:
        return None  # gone meanwhile
    if not is_daemon(argv[:-1] if argv and argv[-1] == "" else argv):
        return None
    sockets = _sockets_of(entry, listening, uid)
    return Daemon(int(entry.name), uid, tuple(a for a in argv if a), sockets)


def is_daemon(argv: tuple[str, ...]) -> bool:
    """Whether ``argv`` is ``stager serve`` without ``--detach``."""
    for at, arg in enumerate(argv[:4]):
        by_module = arg == "-m" and argv[at + 1 : at + 2] == ("stager",)
        if by_module or os.path.basename(arg) == "stager":
            rest = argv[at + (2 if by_module else 1) :]
            return rest[:1] == ("serve",) and "--detach" not in rest
    return False


def _listening_unix_sockets() -> dict[str, list[Path]]:
    """Socket inode -> the paths claimed for it, of every listening Unix socket with a
    path. The kernel prints a path raw, so a newline in it begins a line of the binder's
    choosing: a line that does not parse is dropped, and a path is only a claim, which
    ``_sockets_of`` checks on the disk."""
    try:
        lines = (PROC / "net" / "unix").read_text(errors="replace").splitlines()[1:]
    except OSError:
        return {}
    seen: dict[str, list[Path]] = {}
    for line in lines:
        # Num: RefCount Protocol Flags Type St Inode [Path]; flag 0x10000: listening
        fields = line.split(None, 7)
        if len(fields) != 8 or not fields[0].endswith(":") or not fields[6].isdigit():
            continue
        try:
            flags = int(fields[3], 16)
        except ValueError:
            continue
        if flags & 0x10000 and fields[7].startswith("/"):
            seen.setdefault(fields[6], []).append(Path(fields[7]))
    return seen


def _sockets_of(entry: Path, listening: dict[str, list[Path]], uid: int) -> tuple[Path, ...]:
    """The sockets the process ``entry`` (of user ``uid``) listens on: the paths claimed
    for its descriptors that the disk confirms, a socket that ``uid`` owns in a folder
    ``uid`` owns (a forged line names a path of the forger's, which is not)."""
    sockets = []
    try:
        for fd in (entry / "fd").iterdir():
            target = os.readlink(fd)
            if target.startswith("socket:["):
                claimed = listening.get(target[8:-1], [])
                sockets += [path for path in claimed if _owned_socket(path, uid)]
    except OSError:
        pass  # another user's process: its descriptors are not ours to read
    return tuple(sorted(set(sockets)))


def _owned_socket(path: Path, uid: int) -> bool:
    try:
        sock, folder = os.lstat(path), os.stat(path.parent)
    except OSError:
        return False
    return stat.S_ISSOCK(sock.st_mode) and sock.st_uid == uid and folder.st_uid == uid
