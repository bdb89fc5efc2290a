"""Who is asking: the caller of a request, as the kernel names it.

In the node service the caller comes from ``SO_PEERCRED`` on the Unix socket, read
when the connection is accepted and put in the ASGI scope under :data:`SCOPE_KEY`:
nothing in a request can name another user. In per-user mode it is the daemon's own
user (the socket's folder is 0700). The caller is an explicit argument along a
request's path, never a global.
"""

from __future__ import annotations

import errno
import os
import pwd
import socket
import struct
from dataclasses import dataclass

from stager.rights.become import Identity

# Where the server puts the connection's caller in the ASGI scope.
SCOPE_KEY = "stager.caller"

_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux 4.13+


def peer_groups(sock: socket.socket, gid: int) -> tuple[int, ...]:
    """The supplementary groups of the process at the other end of ``sock`` when it
    connected (the primary group first, as the kernel checks it too)."""
    size = 64 * 4
    while True:
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, size)
            break
        except OSError as exc:
            if exc.errno != errno.ERANGE or size > 65536 * 4:
                raise
            size *= 4
    found = struct.unpack(f"{len(raw) // 4}I", raw)
    return tuple(dict.fromkeys([gid, *found]))


@dataclass(frozen=True)
class Caller:
    """``groups``: the supplementary groups the caller's process held when it connected
    (``SO_PEERGROUPS``), not what the group database says now: a process that dropped
    a group (``setpriv --clear-groups``, ``newgrp``) has dropped it for stager too."""

    uid: int
    gid: int
    pid: int = 0
    groups: tuple[int, ...] = ()

    @property
    def is_root(self) -> bool:
        return self.uid == 0

    @property
    def identity(self) -> Identity:
        """What a process that acts for this caller becomes (stager.rights)."""
        return Identity(self.uid, self.gid, self.groups or (self.gid,))

    @property
    def user_name(self) -> str:
        """The passwd name, or the number for a uid the node does not know."""
        try:
            return pwd.getpwuid(self.uid).pw_name
        except KeyError:
            return str(self.uid)

    @classmethod
    def of_uid(cls, uid: int, gid: int | None = None, groups: tuple[int, ...] = ()) -> Caller:
        """A user named by uid (a handle's owner), with the groups known of them (else the
        primary group alone: fewer rights, never more)."""
        if gid is None:
            try:
                gid = pwd.getpwuid(uid).pw_gid
            except KeyError:
                gid = uid
        return cls(uid=uid, gid=gid, groups=groups or (gid,))

    @classmethod
    def of_process(cls) -> Caller:
        """This process's own identity: the caller of every request in per-user mode."""
        groups = tuple(dict.fromkeys([os.getgid(), *os.getgroups()]))
        return cls(uid=os.getuid(), gid=os.getgid(), pid=os.getpid(), groups=groups)

    @classmethod
    def of_socket(cls, sock: socket.socket) -> Caller:
        """The process at the other end of a connected Unix socket, as the kernel saw it
        connect (``SO_PEERCRED``, ``SO_PEERGROUPS``)."""
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
        pid, uid, gid = _PEERCRED.unpack(raw)
        return cls(uid=uid, gid=gid, pid=pid, groups=peer_groups(sock, gid))
