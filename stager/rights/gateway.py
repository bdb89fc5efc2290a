"""How a staging process reaches a user's paths: through a process that became them.

A staging process writes the cache as root and never opens, lists or stats a user's
path itself: it asks its *gateway*, a process it forks at its start that became the
reader (the user, or ``nobody`` for a shared staging) and answers with descriptors
(stager.rights.agent). Root then holds only what the kernel let that user open.

:class:`DirectAccess` is the same interface on this process's own rights (a per-user
daemon, root for root, trees stager owns). Forked workers each open a channel of their
own to the gateway on first use.
"""

from __future__ import annotations

import os
import socket
import stat
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

from stager.core.processes import GATE_NAME, die_with_parent, fork_child, name_process
from stager.rights import agent, channel
from stager.rights.become import Identity, become, close_fds_except


class ListedEntry:
    """One entry of a folder listed by a gateway: what ``os.DirEntry`` offers the walks
    (its name, its kind and its lstat, taken by the user's process), without a call."""

    __slots__ = ("name", "_st")

    def __init__(self, name: str, st: os.stat_result) -> None:
        self.name = name
        self._st = st

    def stat(self, *, follow_symlinks: bool = True) -> os.stat_result:
        self._not_followed(follow_symlinks)
        return self._st

    def is_dir(self, *, follow_symlinks: bool = True) -> bool:
        self._not_followed(follow_symlinks)
        return stat.S_ISDIR(self._st.st_mode)

    def is_file(self, *, follow_symlinks: bool = True) -> bool:
        self._not_followed(follow_symlinks)
        return stat.S_ISREG(self._st.st_mode)

    def is_symlink(self) -> bool:
        return stat.S_ISLNK(self._st.st_mode)

    def inode(self) -> int:
        return self._st.st_ino

    def _not_followed(self, follow_symlinks: bool) -> None:
        if follow_symlinks and self.is_symlink():
            raise NotImplementedError("a listed link's target is not looked at by root")


class DirectAccess:
    """Paths reached with this process's own rights."""

    def open(self, path: str, flags: int, dir_fd: int | None = None, mode: int = 0o777) -> int:
        return os.open(path, flags, mode, dir_fd=dir_fd)

    def reopen(self, path_fd: int, flags: int) -> int:
        return os.open(f"/proc/self/fd/{path_fd}", flags)

    def open_many(self, dir_fd: int, names: list[str], flags: int) -> list[int]:
        """Each name's descriptor, or minus its errno."""
        return agent.open_each(dir_fd, names, flags)

    def readlink(self, path: str, dir_fd: int | None = None) -> str:
        return os.readlink(path, dir_fd=dir_fd)

    def realpath(self, path: str) -> str:
        return os.path.realpath(path)

    def scandir(self, fd: int) -> AbstractContextManager[Iterator[Any]]:
        return os.scandir(fd)


DIRECT = DirectAccess()


class Gateway(DirectAccess):
    """Paths reached as the user of a process forked for it (:func:`start`)."""

    def __init__(self, sock: socket.socket, pid: int) -> None:
        self._dispenser = sock  # the first channel: workers ask for theirs on it
        self._sock = sock
        self._owner = os.getpid()  # the process whose channel ``_sock`` is
        self.pid = pid
        self._lock = threading.Lock()

    # -- the channel of this process ------------------------------------------------

    def _channel(self) -> socket.socket:
        if self._owner != os.getpid():  # a forked worker: a channel of its own
            mine, theirs = channel.pair()
            channel.send_request(self._dispenser, ("connect",), [theirs.fileno()])
            theirs.close()
            self._sock, self._owner, self._lock = mine, os.getpid(), threading.Lock()
        return self._sock

    def _ask(self, request: tuple[Any, ...], fds: list[int] | tuple[int, ...] = ()) -> Any:
        sock = self._channel()
        with self._lock:
            channel.send_request(sock, request, fds)
            payload, got = channel.recv(sock)
        try:
            return channel.result(channel.decode_answer(payload)), got
        except BaseException:
            for fd in got:
                os.close(fd)
            raise

    def _one_fd(self, request: tuple[Any, ...], fds: list[int] | tuple[int, ...] = ()) -> int:
        _, got = self._ask(request, fds)
        if len(got) != 1:
            for fd in got:
                os.close(fd)
            raise channel.AgentFailed(f"a gateway sent {len(got)} descriptors for one open")
        return got[0]

    # -- the interface ------------------------------------------------------------------

    def open(self, path: str, flags: int, dir_fd: int | None = None, mode: int = 0o777) -> int:
        return self._one_fd(("open", path, flags, mode), () if dir_fd is None else (dir_fd,))

    def reopen(self, path_fd: int, flags: int) -> int:
        return self._one_fd(("reopen", flags), (path_fd,))

    def open_many(self, dir_fd: int, names: list[str], flags: int) -> list[int]:
        numbers, got = self._ask(("open_many", names, flags), (dir_fd,))
        if (
            not isinstance(numbers, list)
            or len(numbers) != len(names)
            or (sum(1 for n in numbers if n == 0) != len(got))
        ):
            for fd in got:
                os.close(fd)
            raise channel.AgentFailed("a gateway's answer to open_many does not add up")
        fds = iter(got)
        return [next(fds) if number == 0 else -int(number) for number in numbers]

    def readlink(self, path: str, dir_fd: int | None = None) -> str:
        text, _ = self._ask(("readlink", path), () if dir_fd is None else (dir_fd,))
        return str(text)

    def realpath(self, path: str) -> str:
        real, _ = self._ask(("realpath", path))
        return str(real)

    def scandir(self, fd: int) -> _Scan:
        return _Scan(self, fd)

    def close(self) -> None:
        """Close this process's channel; the gateway exits once every channel is closed."""
        self._sock.close()


class _Scan(AbstractContextManager["_Scan"]):
    """A folder listed by the gateway, a piece at a time, as an iterator of entries."""

    def __init__(self, gateway: Gateway, fd: int) -> None:
        self._gateway = gateway
        (self._id, piece, self._done), _ = gateway._ask(("scan",), (fd,))
        self._piece = iter(piece)

    def __iter__(self) -> Iterator[ListedEntry]:
        return self

    def __next__(self) -> ListedEntry:
        while True:
            row = next(self._piece, None)
            if row is not None:
                return ListedEntry(row[0], agent.stat_result(row[1:]))
            if self._done:
                raise StopIteration
            (piece, self._done), _ = self._gateway._ask(("scan_next", self._id))
            self._piece = iter(piece)

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._gateway._ask(("scan_close", self._id))

    def __exit__(self, *exc: object) -> None:
        self.close()


def start(identity: Identity) -> Gateway:
    """Fork this process's gateway, which becomes ``identity`` and serves opens until
    every channel to it is closed; it holds no descriptor of root's, and dies with us."""
    mine, theirs = channel.pair()
    parent = os.getpid()

    def gateway() -> int:
        close_fds_except({theirs.fileno()})
        name_process(GATE_NAME)
        become(identity)
        # Credentials changed: the kernel cleared the parent-death signal; set it now.
        die_with_parent()
        if os.getppid() != parent:
            return 1
        agent.serve(theirs)
        return 0

    pid = fork_child(gateway)
    theirs.close()
    return Gateway(mine, pid)
