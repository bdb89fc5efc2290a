"""Who is asking: the caller of a request, as the kernel names it.

In the node service (``stager serve --multi-user``, run as root) the caller comes
from ``SO_PEERCRED`` on the Unix socket connection, read by the server when the
connection is accepted and put in the ASGI scope under :data:`SCOPE_KEY`. Nothing
in a request's headers or body can name another user. In per-user mode every
request comes from the daemon's own user (the socket's folder is 0700), so the
caller is the daemon's process identity.

Inside the daemon the caller is an explicit argument of every request's path,
never a global: the engine keys private data, handles and leases by its uid, and
a staging reads its sources with its credentials (:mod:`stager.fs.credentials`).
"""

from __future__ import annotations

import os
import pwd
import socket
import struct
from dataclasses import dataclass

# Where the server puts the connection's caller in the ASGI scope.
SCOPE_KEY = "stager.caller"

_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


@dataclass(frozen=True)
class Caller:
    uid: int
    gid: int
    pid: int = 0

    @property
    def is_root(self) -> bool:
        return self.uid == 0

    @property
    def user_name(self) -> str:
        """The passwd name, or the number for a uid the node does not know."""
        try:
            return pwd.getpwuid(self.uid).pw_name
        except KeyError:
            return str(self.uid)

    def groups(self) -> tuple[int, ...]:
        """The caller's supplementary groups, as a login would give them (the
        primary group first). A uid without a passwd entry has only its gid."""
        try:
            name = pwd.getpwuid(self.uid).pw_name
        except KeyError:
            return (self.gid,)
        return tuple(dict.fromkeys([self.gid, *os.getgrouplist(name, self.gid)]))

    def home(self) -> str | None:
        try:
            return pwd.getpwuid(self.uid).pw_dir
        except KeyError:
            return None

    @classmethod
    def of_uid(cls, uid: int) -> Caller:
        """A user named by uid alone (a handle's owner), with the passwd entry's gid."""
        try:
            gid = pwd.getpwuid(uid).pw_gid
        except KeyError:
            gid = uid
        return cls(uid=uid, gid=gid)

    @classmethod
    def of_process(cls) -> Caller:
        """This process's own identity: the caller of every request in per-user mode."""
        return cls(uid=os.getuid(), gid=os.getgid(), pid=os.getpid())

    @classmethod
    def of_socket(cls, sock: socket.socket) -> Caller:
        """The process at the other end of a connected Unix socket, from the kernel."""
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
        pid, uid, gid = _PEERCRED.unpack(raw)
        return cls(uid=uid, gid=gid, pid=pid)
