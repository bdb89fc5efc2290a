"""Published trees are read-only and sealed; a hit checks the seal before it answers.

A staging ends by sealing its tree (:func:`seal_tree`, in the staging process): every
file 0444, every folder below the top 0555, no set-id bit, and the same walk measures
the tree as :func:`stager.fs.sizes.sum_sizes` counts. The daemon makes the top 0555
once it is published (:func:`protect_top`): a folder being moved must be writable.

The kernel sets an inode's ctime on every change to it and a folder's mtime on every
entry added, removed or renamed, and nobody but the clock sets either. So a tree is
as published when its entry count and bytes are the same and no ctime below the top
(no mtime of the top, whose ctime the publishing rename moves) is later than the
seal. :func:`check_seal` stats each entry once: what a hit pays before it says ready.

Timestamps come from the kernel's coarse clock and are truncated to the filesystem's
granularity, so the seal is handed out only once a change to the tree's top would be
stamped later (:func:`_stamped_after`).
"""

from __future__ import annotations

import errno
import functools
import os
import stat
import struct
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from stager.fs import forked
from stager.fs.sources import DIR_FLAGS, Folder, Visitor, open_child, open_top_unconfined

FILE_MODE = 0o444
DIR_MODE = 0o555
# How long a seal waits for a stamp later than it (see _sealed): more than any
# filesystem's granularity (whole seconds at the coarsest).
_STAMP_WAIT_S = 2.0
# Entries per chunk handed to a worker, and trees sealed on the walking process alone.
BATCH = 1024
PARALLEL_AFTER = 20_000


@dataclass(frozen=True)
class Seal:
    """What a published tree must still be: ``entries`` and ``nbytes`` below the top
    (files, links and folders; bytes of files and links), nothing changed after
    ``sealed_ns`` (nanoseconds of the realtime clock)."""

    entries: int
    nbytes: int
    sealed_ns: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Seal:
        return cls(int(data["entries"]), int(data["nbytes"]), int(data["sealed_ns"]))


def seal_tree(root: Path, workers: int) -> Seal:
    """Make the tree under ``root`` read-only (its top excepted) and seal it."""
    tally = _Tally()
    sealer = _Sealer(forked.Workers(forked.cores(workers), tally, PARALLEL_AFTER))
    top = open_top_unconfined(str(root))
    try:
        sealer.workers.walk(top, sealer, "skip", flush=sealer.submit)
    finally:
        os.close(top.fd)
    return _sealed(root, entries=tally.files + sealer.folders, nbytes=tally.nbytes)


@dataclass(frozen=True)
class KnownTree:
    """What an op that alone made a tree knows of it: its bytes (as ``sum_sizes``
    counts), its entries and its folders, so that no listing is needed to seal it."""

    nbytes: int
    entries: int
    folders: tuple[str, ...]

    def under(self, folder: str) -> KnownTree:
        """The same, made under ``folder`` (relative; its components made by the op)."""
        parts = [part for part in folder.split("/") if part not in ("", ".")]
        above = tuple("/".join(parts[: i + 1]) for i in range(len(parts)))
        prefix = "/".join(parts)
        inside = tuple(f"{prefix}/{f}" if prefix else f for f in self.folders)
        return KnownTree(self.nbytes, self.entries + len(above), above + inside)


def seal_listed(root: Path, made: int | KnownTree) -> Seal:
    """The seal of a tree whose one op created every file read-only and counted its
    bytes (``read_only_files``): folders made read-only and entries counted from their
    listings; or, with a ``KnownTree``, from what the op knows, listing nothing."""
    if isinstance(made, KnownTree):
        for folder in made.folders:
            os.chmod(root / folder, DIR_MODE)
        return _sealed(root, entries=made.entries, nbytes=made.nbytes)
    nbytes = made
    top = open_top_unconfined(str(root))
    try:
        entries = _list_tree(top.fd)
    finally:
        os.close(top.fd)
    return _sealed(root, entries=entries, nbytes=nbytes)


def _list_tree(top: int) -> int:
    """Entries below the open folder ``top``, each folder below it made read-only.
    Its own loop, since a ``Visitor``'s calls cost as much again as the listing; each
    folder opened by name relative to its parent, never through a link."""
    entries = 0
    stack: list[tuple[int, list[str]]] = []
    fd = top
    try:
        while fd >= 0:
            folders = []
            try:
                with os.scandir(fd) as listing:
                    for entry in listing:
                        entries += 1
                        if entry.is_dir(follow_symlinks=False):
                            folders.append(entry.name)
                if fd != top:
                    os.chmod(fd, DIR_MODE)
            except BaseException:
                if fd != top:
                    os.close(fd)
                raise
            stack.append((fd, folders))
            fd = -1
            while stack and fd < 0:
                parent, names = stack[-1]
                if names:
                    fd = os.open(names.pop(), DIR_FLAGS | os.O_NOFOLLOW, dir_fd=parent)
                else:
                    stack.pop()
                    if parent != top:
                        os.close(parent)
        return entries
    finally:
        for parent, _names in stack:
            if parent != top:
                os.close(parent)


def _sealed(root: Path, entries: int, nbytes: int) -> Seal:
    """The seal of the tree at ``root``, whose last change was made: taken now, and
    returned once any change from then on is stamped later than it, so that the tree
    may be published at once (a tick of the coarse clock at most)."""
    seal = Seal(entries=entries, nbytes=nbytes, sealed_ns=time.time_ns())
    # A filesystem that does not stamp a chmod (none Linux mounts locally) would never
    # say so: after _STAMP_WAIT_S the seal goes as it is.
    deadline = time.monotonic() + _STAMP_WAIT_S
    while not _stamped_after(seal.sealed_ns, root) and time.monotonic() < deadline:
        time.sleep(0.001)
    return seal


def _stamped_after(sealed_ns: int, top: Path) -> bool:
    """Whether the kernel stamps a change to the tree's top folder made now (a ``chmod``
    to its own mode, which moves only its ctime) later than ``sealed_ns``; then so is
    any later change to the tree, since a local filesystem never stamps earlier than
    before. With multigrain timestamps (Linux 6.13+) the second change here, a look
    after the first, makes it hold at once; without, within a coarse tick; on a
    filesystem of whole seconds, once the second has turned."""
    for _ in range(2):
        mode = stat.S_IMODE(os.stat(top).st_mode)  # the look
        os.chmod(top, mode)  # the change
        if os.stat(top).st_ctime_ns > sealed_ns:
            return True
    return False


# The top of a tree only one user may read (the node service's private copies): the
# service's, like everything inside, with an access ACL that lets that user (and root)
# in and nobody else. The user can read their copy and cannot change it: not its mode,
# not its entries (nothing is theirs), so root never deletes a tree they could write.
PRIVATE_TOP_MODE = 0o550  # with the ACL below: its group bits are the ACL's mask
ACL_XATTR = "system.posix_acl_access"
_ACL_USER_OBJ, _ACL_USER, _ACL_GROUP_OBJ, _ACL_MASK, _ACL_OTHER = 0x01, 0x02, 0x04, 0x10, 0x20
_NO_ID = 0xFFFFFFFF


def top_mode(owner: int | None) -> int:
    return DIR_MODE if owner is None else PRIVATE_TOP_MODE


def private_acl(owner: int) -> bytes:
    """The access ACL of a private copy's top: owner (root) r-x, user ``owner`` r-x,
    nobody else."""
    return _acl(5, owner, 5)


def gate_acl(owner: int) -> bytes:
    """The access ACL of a user's folder under ``data/u/`` (stager.state.layout): owner (root)
    rwx, user ``owner`` search alone (``--x``: they list nothing), nobody else."""
    return _acl(7, owner, 1)


def _acl(root: int, owner: int, theirs: int) -> bytes:
    """An access ACL in the kernel's xattr form (version 2, then tag, perms and id of
    each entry): the file's owner ``root``, user ``owner`` ``theirs``, nobody else."""
    entries = [
        (_ACL_USER_OBJ, root, _NO_ID),
        (_ACL_USER, theirs, owner),
        (_ACL_GROUP_OBJ, 0, _NO_ID),
        (_ACL_MASK, theirs, _NO_ID),
        (_ACL_OTHER, 0, _NO_ID),
    ]
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *entry) for entry in entries)


def protect_top(root: Path, owner: int | None = None) -> None:
    """The published tree's top folder, read-only too (see the module's docstring); with
    ``owner``, the top of that user's own copy, which only they may enter (an ACL:
    the folder stays the service's). Opened without following a link."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if owner is None:
            os.fchmod(fd, DIR_MODE)
        else:
            os.setxattr(fd, ACL_XATTR, private_acl(owner))  # sets the mode bits too
    finally:
        os.close(fd)


def top_protected(fd: int, st: os.stat_result, owner: int | None) -> bool:
    """Whether a top is as :func:`protect_top` left it for ``owner``."""
    if stat.S_IMODE(st.st_mode) != top_mode(owner) or st.st_uid != os.geteuid():
        return False
    try:
        acl = os.getxattr(fd, ACL_XATTR)
    except OSError as exc:
        if exc.errno not in (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
        acl = None
    return acl == (private_acl(owner) if owner is not None else None)


def check_acls(folder: Path) -> None:
    """Refuse a cache whose filesystem cannot hold the private copies' ACLs (the node
    service checks at its start)."""
    probe = folder / f".acl-probe-{os.getpid()}"
    probe.mkdir(mode=0o700, exist_ok=True)
    try:
        protect_top(probe, owner=65534)
    except OSError as exc:
        raise OSError(
            exc.errno,
            f"{folder} is on a filesystem without POSIX ACLs, which the node service needs "
            "to give each user a private copy only they may read; put the cache on ext4, "
            "xfs or tmpfs (mounted with acl)",
        ) from exc
    finally:
        probe.rmdir()


def open_up_top(root: Path) -> None:
    """Let the tree's owner move it away (an eviction renames it into the trash)."""
    os.chmod(root, DIR_MODE | stat.S_IWUSR)


def check_seal(root: Path, seal: Seal, owner: int | None = None, workers: int = 1) -> str | None:
    """None when the tree is as sealed (its top as :func:`protect_top` left it for
    ``owner``); else a sentence naming what changed. The files are looked at on
    ``workers`` forked processes once the tree is large (never fork a process that
    runs threads: the daemon asks its walker process, ``Processes.run_in_walker``)."""
    tally = _Tally()
    checker = _Checker(seal.sealed_ns, forked.Workers(forked.cores(workers), tally, PARALLEL_AFTER))
    try:
        top = open_top_unconfined(str(root))
    except FileNotFoundError:
        return f"{root} is gone"
    try:
        if top.st.st_mtime_ns > seal.sealed_ns:
            return f"an entry of {root} was added, removed or renamed after it was published"
        if not top_protected(top.fd, top.st, owner):
            return f"{root} had its owner, mode or ACL changed after it was published"
        checker.workers.walk(top, checker, "skip", flush=checker.submit)
    except _Changed as changed:
        return str(changed)
    finally:
        os.close(top.fd)
    entries, nbytes = tally.files + checker.folders, tally.nbytes
    if (entries, nbytes) != (seal.entries, seal.nbytes):
        return (
            f"{root} holds {entries} entries and {nbytes} bytes, "
            f"not the {seal.entries} and {seal.nbytes} it was published with"
        )
    return None


class _Changed(Exception):
    pass


class _Tally:
    """The ProgressSink the workers' counters are summed into."""

    def __init__(self) -> None:
        self.nbytes = self.files = 0

    def add_total(self, nbytes: int = 0, files: int = 0) -> None:
        pass

    def advance(self, nbytes: int = 0, files: int = 0) -> None:
        self.nbytes += nbytes
        self.files += files


class _Sealer(Visitor):
    """Hands each folder's non-folder entries to the workers in chunks; makes each
    folder below the top read-only once its chunks are handed out."""

    def __init__(self, workers: forked.Workers) -> None:
        self.workers = workers
        self.pending: dict[int, list[str]] = {}
        self.groups: list[tuple[str, list[str]]] = []
        self.count = 0
        self.folders = 0
        self.judge: Callable[[int, str, str, os.stat_result], None] = _make_read_only

    def file(self, folder: Folder, entry: os.DirEntry[str]) -> None:
        names = self.pending.setdefault(folder.fd, [])
        names.append(entry.name)
        if len(names) >= BATCH:
            self._hand_out(folder)

    link = special = file  # type: ignore[assignment]

    def subdir(self, folder: Folder, entry: os.DirEntry[str]) -> Folder | None:
        self.folders += 1
        return open_child(folder, entry.name)

    def leave(self, folder: Folder) -> None:
        self._hand_out(folder)
        if folder.rel:
            # Entries are made read-only by path relative to this folder, which needs
            # only search permission on it: 0555 keeps that.
            os.chmod(folder.fd, DIR_MODE)

    def _hand_out(self, folder: Folder) -> None:
        names = self.pending.pop(folder.fd, None)
        if names:
            self.groups.append((folder.path, names))
            self.count += len(names)
            if self.count >= BATCH:
                self.submit()

    def submit(self) -> None:
        if self.groups:
            groups, count = self.groups, self.count
            self.groups, self.count = [], 0
            self.workers.submit(_each_entry, groups, self.judge, files=count)


def _make_read_only(dfd: int, path: str, name: str, st: os.stat_result) -> None:
    """Each file 0444 (links and special files as they are)."""
    if stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) != FILE_MODE:
        os.chmod(name, FILE_MODE, dir_fd=dfd, follow_symlinks=False)


def _each_entry(
    groups: list[tuple[str, list[str]]],
    judge: Callable[[int, str, str, os.stat_result], None],
) -> None:
    """A chunk, on a worker: ``judge`` each folder's named entries by their ``lstat``
    (relative to the folder's descriptor), then count their sizes."""
    for path, names in groups:
        if forked.stopping():
            return
        dfd = os.open(path, DIR_FLAGS | os.O_NOFOLLOW)
        try:
            nbytes = 0
            for name in names:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                judge(dfd, path, name, st)
                nbytes += st.st_size
        finally:
            os.close(dfd)
        forked.report(nbytes, len(names))


class _Checker(_Sealer):
    """Walks as the sealer does, each entry judged unchanged since the seal (raised on
    the walking process otherwise); looks at the folders itself."""

    def __init__(self, sealed_ns: int, workers: forked.Workers) -> None:
        super().__init__(workers)
        self.sealed_ns = sealed_ns
        self.judge = functools.partial(_unchanged, sealed_ns)

    def subdir(self, folder: Folder, entry: os.DirEntry[str]) -> Folder | None:
        child = open_child(folder, entry.name)
        if child.st.st_ctime_ns > self.sealed_ns or stat.S_IMODE(child.st.st_mode) != DIR_MODE:
            os.close(child.fd)
            raise _Changed(f"{child.path} changed after it was published")
        self.folders += 1
        return child

    def leave(self, folder: Folder) -> None:
        self._hand_out(folder)


def _unchanged(sealed_ns: int, dfd: int, path: str, name: str, st: os.stat_result) -> None:
    if st.st_ctime_ns > sealed_ns:
        raise _Changed(f"{path}/{name} changed after it was published")
    if stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) != FILE_MODE:
        raise _Changed(f"{path}/{name} is no longer read-only")
