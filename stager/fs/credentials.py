"""Reading sources as the user who asked: the kernel decides, on every open.

The node service writes its cache as root but never reads a source with root's
rights: stager never asks ``access()`` or compares modes; a process that *became* the
user (stager.rights) opens the source, and the open succeeds or fails.

- The request-time checks run whole in one of the caller's user processes
  (stager.rights.pool).
- A staging process reaches sources only through its *access* (:func:`access`): a
  gateway that became the reader and hands back descriptors (stager.rights.gateway),
  or, per user or for root, its own rights. :func:`read_sources_as` chooses it at the
  staging's start; forked workers inherit it and open channels of their own.

A staging every user shares is read as ``nobody``, and each source it opens must be
readable by everyone (:func:`check_public`).
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass

from stager.core.errors import NotPublic
from stager.core.identity import Caller
from stager.rights.become import Identity, nobody
from stager.rights.gateway import DIRECT, DirectAccess
from stager.rights.gateway import start as start_gateway


@dataclass(frozen=True)
class Reader:
    """Whose rights a staging reads its sources with: a user's uid, gid and groups.

    ``public``: shared by every user, so read as ``nobody`` and every source must be
    readable by everyone; unless ``vouched``: a broadcast copy another node's service
    vouches for (stager.core.vouch), read from the delivering user's folder as them."""

    uid: int
    gid: int
    groups: tuple[int, ...]
    public: bool = False
    vouched: bool = False

    @property
    def identity(self) -> Identity:
        """The user who asked, as their process was when it connected."""
        return Identity(self.uid, self.gid, tuple(self.groups))

    def reads_as(self) -> Identity:
        """Who the staging's gateway becomes."""
        return nobody() if self.public and not self.vouched else self.identity


def reader_of(caller: Caller, public: bool = False) -> Reader:
    return Reader(caller.uid, caller.gid, caller.groups, public)


# -- the staging process -----------------------------------------------------------

_sources_reader: Reader | None = None
_access: DirectAccess = DIRECT


def read_sources_as(reader: Reader | None) -> None:
    """In a staging process: every source access from now on is made as ``reader``
    (None: with this process's own rights), through a gateway that became them."""
    global _sources_reader, _access
    _sources_reader = reader
    if reader is None or reader.reads_as().is_root:
        _access = DIRECT
    elif reader.public and not reader.vouched:
        _access = _Everyone(start_gateway(reader.reads_as()))
    else:
        _access = start_gateway(reader.reads_as())


class _Everyone(DirectAccess):
    """A shared staging's access: ``nobody`` refused an open, so not everyone may read
    that source (NotPublic: each waiting name gets its owner's own staging)."""

    def __init__(self, gateway: DirectAccess) -> None:
        self._gateway = gateway

    def open(self, path: str, flags: int, dir_fd: int | None = None, mode: int = 0o777) -> int:
        return self._everyone(self._gateway.open, path, path, flags, dir_fd, mode)

    def reopen(self, path_fd: int, flags: int) -> int:
        return self._everyone(self._gateway.reopen, "a source", path_fd, flags)

    def open_many(self, dir_fd: int, names: list[str], flags: int) -> list[int]:
        opened = self._gateway.open_many(dir_fd, names, flags)
        if -errno.EACCES in opened:
            for fd in opened:
                if fd >= 0:
                    os.close(fd)
            raise _not_public(names[opened.index(-errno.EACCES)], "nobody may open it")
        return opened

    def readlink(self, path: str, dir_fd: int | None = None) -> str:
        return self._everyone(self._gateway.readlink, path, path, dir_fd)

    def realpath(self, path: str) -> str:
        return self._everyone(self._gateway.realpath, path, path)

    def scandir(self, fd: int):  # type: ignore[no-untyped-def]
        return self._gateway.scandir(fd)

    @staticmethod
    def _everyone(call, shown, *args):  # type: ignore[no-untyped-def]
        try:
            return call(*args)
        except PermissionError:
            raise _not_public(str(shown), "nobody may open it") from None


def source_reader() -> Reader | None:
    return _sources_reader


def access() -> DirectAccess:
    """How this process reaches sources (see :func:`read_sources_as`)."""
    return _access


# A file readable by everyone: read for owner, group and others (a member of the
# owning group gets the group's bits, not the others'); a folder: read and search too.
EVERYONE_FILE = stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH
EVERYONE_DIR = EVERYONE_FILE | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH
_ACL_XATTR = "system.posix_acl_access"


def not_readable_by_everyone(fd: int, st: os.stat_result | None = None) -> str | None:
    """Why the open object ``fd`` is not readable by everyone, or None if it is: its
    mode, or an access ACL (which could narrow it for a named user or group; any ACL
    counts, so nothing is shared on a guess)."""
    st = st or os.fstat(fd)
    need = EVERYONE_DIR if stat.S_ISDIR(st.st_mode) else EVERYONE_FILE
    if stat.S_IMODE(st.st_mode) & need != need:
        return f"its mode is {stat.S_IMODE(st.st_mode):04o}"
    return "it has an access ACL" if _has_acl(fd) else None


def path_readable_by_everyone(path: str) -> bool:
    """Whether every user could reach and read ``path`` (links resolved): each folder
    above it searchable by all, itself readable by all. A few ``stat`` calls, before a
    request asks for a shared staging (which checks every file it opens)."""
    real = os.path.realpath(path)
    parts = real.split("/")[1:]
    search = stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH
    for depth in range(len(parts)):
        folder = "/" + "/".join(parts[:depth])
        try:
            fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            st = os.fstat(fd)
            if stat.S_IMODE(st.st_mode) & search != search or _has_acl(fd):
                return False
        finally:
            os.close(fd)
    try:
        fd = os.open(real, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
            return False
        readable = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return False
    finally:
        os.close(fd)
    try:
        return not_readable_by_everyone(readable) is None
    finally:
        os.close(readable)


def _has_acl(fd: int) -> bool:
    try:
        os.getxattr(fd, _ACL_XATTR)
    except OSError as exc:
        if exc.errno in (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP):
            return False
        raise
    return True


def check_public(fd: int, shown: str, st: os.stat_result | None = None) -> None:
    """In a staging to be shared, refuse a source that not everyone could read."""
    reader = _sources_reader
    if reader is None or not reader.public or reader.vouched:
        return
    why = not_readable_by_everyone(fd, st)
    if why is not None:
        raise _not_public(shown, why)


def _not_public(shown: str, why: str) -> NotPublic:
    return NotPublic(
        f"source {shown} is not readable by everyone ({why}), so this staging cannot "
        "be shared by every user; it is staged again for the asking user alone"
    )
