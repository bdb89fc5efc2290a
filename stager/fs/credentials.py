"""Reading sources as the user who asked: the kernel decides, on every open.

The node service runs as root and writes its cache as root, but it must never
read a source with root's rights: a user may stage only what they could have read
themselves. stager never asks ``access()`` or compares modes to decide that; it
opens the source with the user's credentials and lets the open succeed or fail.

Linux checks file access against a thread's *filesystem* uid and gid and its
supplementary groups, and drops the capabilities that bypass those checks
(``CAP_DAC_OVERRIDE``, ``CAP_DAC_READ_SEARCH``, ``CAP_FOWNER``...) while the
filesystem uid is not 0. All three are per thread in the kernel. glibc makes
``setgroups`` apply to every thread of a process (POSIX asks for it), so the
groups are set here with the raw system call, which changes the calling thread
alone; ``setfsuid`` and ``setfsgid`` are per thread already. A thread that holds
a user's credentials therefore reads as that user, while every other thread of
the daemon goes on as root; and a thread gives them back before it does anything
else (:func:`reading_as`, a context manager).

Two places read sources:

- the daemon's request-time checks (the fingerprint, the pre-flight check of
  each step, the link's folder): the whole call runs with the user's
  credentials on its ``run_io`` thread (:func:`as_user`);
- the staging process, which writes the cache as root and reads the sources
  as the user: it records the user once (:func:`read_sources_as`, which also sets
  the process's groups), and each open of a source, in :mod:`stager.fs.sources`
  and the copy's workers, takes the user's filesystem uid and gid around itself
  (:func:`as_reader`). Forked workers inherit both.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

from stager.errors import NotPublic
from stager.identity import Caller

P = ParamSpec("P")
T = TypeVar("T")

_libc = ctypes.CDLL(None, use_errno=True)
# setgroups(2)'s number, which glibc's wrapper would broadcast to every thread.
_SYS_SETGROUPS = {"x86_64": 116, "aarch64": 159, "ppc64le": 81, "s390x": 206}.get(
    platform.machine()
)


@dataclass(frozen=True)
class Reader:
    """The credentials a staging reads its sources with: a user's uid, gid and groups.

    ``public``: the staging is to be shared by every user of the node, so every
    source it opens must be readable by everyone (:func:`check_public`), unless
    ``vouched``: it reads a broadcast copy whose every byte another node's service
    vouches for (stager.vouch), so the copy's files need only be readable by the user
    whose job delivered them."""

    uid: int
    gid: int
    groups: tuple[int, ...]
    public: bool = False
    vouched: bool = False


def _set_fs_ids(uid: int, gid: int, check: bool = True) -> tuple[int, int]:
    """Set this thread's filesystem gid and uid; returns the previous ones. ``check``:
    make sure they took (once per staging process is enough: rights do not change)."""
    old_gid = _libc.setfsgid(gid)
    old_uid = _libc.setfsuid(uid)
    # setfs*id report no error; asking with -1 returns the value in force.
    if check and (_libc.setfsuid(-1) != uid or _libc.setfsgid(-1) != gid):
        _libc.setfsuid(old_uid)
        _libc.setfsgid(old_gid)
        raise PermissionError(errno.EPERM, f"cannot take the credentials of uid {uid}")
    return old_uid, old_gid


def _set_thread_groups(groups: tuple[int, ...]) -> None:
    if _SYS_SETGROUPS is None:
        raise OSError(errno.ENOSYS, f"per-thread groups are not known on {platform.machine()}")
    array = (ctypes.c_uint * max(1, len(groups)))(*groups)
    if _libc.syscall(_SYS_SETGROUPS, len(groups), array) != 0:
        number = ctypes.get_errno()
        raise OSError(number, os.strerror(number))


@contextmanager
def reading_as(reader: Reader) -> Iterator[None]:
    """This thread reads as ``reader`` inside the block (groups included)."""
    saved_groups = tuple(os.getgroups())  # this thread's own: getgroups is per thread
    _set_thread_groups(reader.groups)
    try:
        old = _set_fs_ids(reader.uid, reader.gid)
    except BaseException:
        _set_thread_groups(saved_groups)
        raise
    try:
        yield
    finally:
        _set_fs_ids(*old)
        _set_thread_groups(saved_groups)


def as_user(reader: Reader | None, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """``fn(*args)`` with ``reader``'s credentials on this thread (None: as the daemon)."""
    if reader is None:
        return fn(*args, **kwargs)
    with reading_as(reader):
        return fn(*args, **kwargs)


def reader_of(caller: Caller, public: bool = False) -> Reader:
    return Reader(caller.uid, caller.gid, caller.groups(), public)


# -- the staging process -----------------------------------------------------------

_sources_reader: Reader | None = None


def read_sources_as(reader: Reader | None) -> None:
    """In a staging process: every source open from now on is made as ``reader``.
    The process's groups become the user's here (files are written with filesystem
    uid 0, which no group check applies to)."""
    global _sources_reader
    _sources_reader = reader
    if reader is not None:
        os.setgroups(list(reader.groups))
        _set_fs_ids(*_set_fs_ids(reader.uid, reader.gid))  # fails here if it cannot


def source_reader() -> Reader | None:
    return _sources_reader


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
    above it searchable by owner, group and others, itself readable by everyone
    (:func:`not_readable_by_everyone`). A few ``stat`` calls: the cheap look a request
    takes before it asks for a shared staging, which checks every file it opens."""
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
        raise NotPublic(
            f"source {shown} is not readable by everyone ({why}), so this staging cannot "
            "be shared by every user; it is staged again for the asking user alone"
        )


def as_reader(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """One source access (an open, a stat, a readlink) with the staging's reader's
    filesystem ids, if it has one."""
    reader = _sources_reader
    if reader is None:
        return fn(*args, **kwargs)
    old = _set_fs_ids(reader.uid, reader.gid, check=False)
    try:
        return fn(*args, **kwargs)
    finally:
        _set_fs_ids(*old, check=False)
