"""Becoming a user entirely: the only way stager acts for a user on the node.

A process that acts for a user first *becomes* them: gids, the groups the user's
process held when it connected (not the group database's), then uids, all real,
effective and saved. Linux clears every capability when the last uid leaves 0
(``CapEff`` 0: no ``CAP_DAC_READ_SEARCH``, no ``CAP_SYS_PTRACE``); ``no_new_privs``
keeps it from regaining any through a set-id program, and it is not dumpable, so the
user cannot reach its descriptors through ``/proc``.

A root thread with a switched filesystem uid is *not* this: it keeps
``CAP_SYS_PTRACE``, and the kernel lets it through ``/proc/<pid>/cwd`` of any process.
"""

from __future__ import annotations

import ctypes
import grp
import os
import pwd
from dataclasses import dataclass

from stager.core.libc import LIBC

_PR_SET_DUMPABLE = 4
_PR_SET_NO_NEW_PRIVS = 38


@dataclass(frozen=True)
class Identity:
    """A user as the kernel knows a process of theirs: uid, gid, supplementary groups."""

    uid: int
    gid: int
    groups: tuple[int, ...] = ()

    @property
    def is_root(self) -> bool:
        return self.uid == 0


def nobody() -> Identity:
    """The node's unprivileged user, in no group but its own: what everyone may read,
    it may read, and nothing more. Shared stagings read their sources as it, so that no
    user's rights (nor that user's signals) reach a staging other users wait on."""
    try:
        uid = pwd.getpwnam("nobody").pw_uid
    except KeyError:
        uid = 65534
    try:
        gid = grp.getgrnam("nogroup").gr_gid
    except KeyError:
        gid = 65534
    return Identity(uid, gid, ())


class BecomeError(OSError):
    """The process could not drop to the user; it must not go on."""


def become(identity: Identity) -> None:
    """Make this process ``identity`` for good: gid, groups, uid (real, effective and
    saved), no capability, no new privileges, not dumpable. Raises BecomeError if any
    of it did not take; the caller exits then (it must never act as root instead)."""
    if identity.is_root:
        raise BecomeError("stager never becomes root for a user; a root caller acts as itself")
    os.setresgid(identity.gid, identity.gid, identity.gid)
    os.setgroups(list(identity.groups))
    os.setresuid(identity.uid, identity.uid, identity.uid)
    if LIBC.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise BecomeError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
    LIBC.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    held = effective_capabilities()
    if (
        os.getresuid() != (identity.uid,) * 3
        or os.getresgid() != (identity.gid,) * 3
        or set(os.getgroups()) != set(identity.groups)
        or held
    ):
        raise BecomeError(f"could not become uid {identity.uid} entirely (CapEff {held:#x})")


_PR_CAPBSET_DROP = 24
_LINUX_CAPABILITY_VERSION_3 = 0x20080522


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def drop_capabilities() -> None:
    """Stay uid 0 but hold no capability, now or after any exec: a staging process
    writes the cache's folders as their owner and needs nothing more; should it open a
    user's path itself (a bug), the kernel checks it like anyone's. The bounding set
    goes first (it needs ``CAP_SETPCAP``), so a program it runs cannot regain them."""
    last = int(open("/proc/sys/kernel/cap_last_cap").read())
    for cap in range(last + 1):
        if LIBC.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise BecomeError(ctypes.get_errno(), f"could not drop capability {cap}")
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    if LIBC.capset(ctypes.byref(header), data) != 0:
        raise BecomeError(ctypes.get_errno(), "capset failed")
    if LIBC.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise BecomeError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
    if effective_capabilities():
        raise BecomeError("capabilities are still held after dropping them")


def effective_capabilities(pid: int | str = "self") -> int:
    """The ``CapEff`` mask of process ``pid``, from ``/proc/<pid>/status``."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    raise OSError(f"/proc/{pid}/status has no CapEff line")


def close_fds_except(keep: set[int]) -> None:
    """Close every descriptor of this process but ``keep``, and put /dev/null on 0-2:
    a process that becomes a user must hold nothing of root's (the cache's folders,
    the daemon's log, its sockets)."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        if fd not in keep and fd != null:
            os.dup2(null, fd)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass  # the listing's own descriptor, closed already
