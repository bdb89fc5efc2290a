"""Space an eviction did not free: on its owner's books until the kernel frees it.

Two things keep an evicted dataset's blocks in use: a lazily unmounted image a process
still reads, whose file is moved to ``partial/held-<uid>-<key>-<hex><suffix>`` (the
name says whose) and deleted once a write lease (``F_SETLEASE``, granted only to a
file's sole opener) says nothing holds it (the loop device, the file-backed mount and a
FUSE reader hold it until the mount is really gone; a lazily detached mount is already
missing from ``/proc/self/mountinfo``); and a deleted tree's files still open or mapped,
found by their ``/proc/<pid>/fd`` and ``map_files`` links once the tree is moved aside.
Each is a :class:`Record` charged to its owner (``None``: shared) until
:meth:`HeldSpace.sweep` finds it freed. Records are never stored: a start finds them
again (held images by their names, open deleted files under the trash).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import threading
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from stager.fs.durable_names import sync_folder
from stager.staging.publish import DISCARDED_PREFIX

log = logging.getLogger("stager.engine.held_space")

HELD_PREFIX = "held-"
F_SETLEASE = 1024  # linux/fcntl.h (F_LINUX_SPECIFIC_BASE + 0)
SHARED = "all"  # the owner part of a held file's name for a dataset shared by everyone


@dataclass
class Record:
    """``files`` kept until nothing holds them open (an image), or ``folder`` whose
    deleted files are still open (a tree)."""

    key: str
    owner: int | None
    nbytes: int
    files: tuple[Path, ...] = ()
    folder: Path | None = None
    inodes: set[tuple[int, int]] = field(default_factory=set)


def held_open(path: Path) -> bool:
    """Whether anything but this call holds ``path`` open."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return False
    try:
        fcntl.fcntl(fd, F_SETLEASE, fcntl.F_WRLCK)
    except OSError as exc:
        if exc.errno == errno.EAGAIN:
            return True
        # No leases here (fs.leases-enable=0, a file system without them): nothing
        # tells, and a file kept on that guess would be kept for good.
        log.warning("cannot tell whether %s is still held open (%s); deleted", path, exc)
        return False
    else:
        fcntl.fcntl(fd, F_SETLEASE, fcntl.F_UNLCK)
        return False
    finally:
        os.close(fd)


Open = dict[tuple[int, int], tuple[int, str, int]]  # (dev, inode) -> (bytes, path, uid)


def open_under(folder: Path) -> Open:
    """The files under ``folder`` (or once under it) that a process holds open or
    mapped, as (device, inode) -> (bytes held, path, uid of a holder)."""
    prefix = str(folder).rstrip("/") + "/"
    found: Open = {}
    for pid in _pids():
        for link, path in _links_under(pid, prefix):
            with contextlib.suppress(OSError):  # closed or gone meanwhile
                st = os.stat(link)
                found[(st.st_dev, st.st_ino)] = (st.st_blocks * 512, path, _uid(pid))
    return found


def holder_of(device: int, files: bool = True) -> int | None:
    """The lowest uid (not root, not this daemon's) with a process whose working or
    root folder, or (``files``) an open file or mapping, is on ``device``. Without
    ``files``, two system calls a process: cheap whatever users do."""
    found = set()
    for pid in _pids():
        if _on_device(f"/proc/{pid}", device, files):
            found.add(_uid(pid))
    users = found - {0, os.geteuid(), -1}
    return min(users) if users else None


def _on_device(proc: str, device: int, files: bool) -> bool:
    links = [f"{proc}/cwd", f"{proc}/root"]
    if files:
        with contextlib.suppress(OSError):
            links += [f"{proc}/fd/{fd}" for fd in os.listdir(f"{proc}/fd")]
    for link in links:
        with contextlib.suppress(OSError):
            if os.stat(link).st_dev == device:
                return True
    if not files:
        return False
    with contextlib.suppress(OSError), open(f"{proc}/maps", encoding="utf-8") as lines:
        for line in lines:
            parts = line.split(maxsplit=5)
            if len(parts) >= 5 and parts[4] != "0":
                major, minor = (int(n, 16) for n in parts[3].split(":"))
                if os.makedev(major, minor) == device:
                    return True
    return False


def _uid(pid: str) -> int:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return -1


def _pids() -> list[str]:
    return [name for name in os.listdir("/proc") if name.isdigit()]


def _links_under(pid: str, prefix: str) -> Iterable[tuple[str, str]]:
    """``/proc/<pid>`` links (descriptors and mappings) to files under ``prefix``."""
    fds = f"/proc/{pid}/fd"
    with contextlib.suppress(OSError):
        for name in os.listdir(fds):
            with contextlib.suppress(OSError):
                target = os.readlink(f"{fds}/{name}")
                if target.startswith(prefix):
                    yield f"{fds}/{name}", target.removesuffix(" (deleted)")
    maps = f"/proc/{pid}/maps"
    with contextlib.suppress(OSError), open(maps, encoding="utf-8", errors="replace") as lines:
        for line in lines:
            parts = line.rstrip("\n").split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith(prefix):
                yield f"/proc/{pid}/map_files/{parts[0]}", parts[5].removesuffix(" (deleted)")


class HeldSpace:
    """The records of space still held; ``folder``: where held images wait."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        # Replaced whole, never changed in place: the event loop reads it while the
        # threads that look at /proc (through run_io) add and drop records.
        self.records: list[Record] = []
        self._lock = threading.Lock()

    def _add(self, record: Record) -> None:
        with self._lock:
            self.records = [*self.records, record]

    # ---- the books -------------------------------------------------------------------

    def bytes_of(self, owner: int) -> int:
        return sum(r.nbytes for r in self.records if r.owner == owner)

    @property
    def total_bytes(self) -> int:
        return sum(r.nbytes for r in self.records)

    # ---- what goes on them (blocking: through run_io) -----------------------------------

    def keep_image(
        self, key: str, owner: int | None, nbytes: int, files: list[Path]
    ) -> Record | None:
        """A lazily unmounted image's files, moved aside and charged to ``owner``; its
        record, or None if no file was there."""
        stem = f"{HELD_PREFIX}{SHARED if owner is None else owner}-{key}-{uuid.uuid4().hex[:8]}"
        kept = []
        for file in files:
            if not os.path.lexists(file):
                continue
            # Only the suffixes are kept: the name may be the key's place, not the key.
            moved = self.folder / (stem + file.name[file.name.index(".") :])
            os.rename(file, moved)
            kept.append(moved)
        if not kept:
            return None
        sync_folder(self.folder)
        record = Record(key, owner, nbytes, files=tuple(kept))
        self._add(record)
        log.warning(
            "%s: %d bytes still held by a lazily unmounted image, on uid %s's books "
            "until its readers let go",
            key,
            nbytes,
            SHARED if owner is None else owner,
        )
        return record

    def charge_holder(self, record: Record, device: int) -> None:
        """A shared image's held space, charged to a user whose process holds its mount
        (so no user holds space counted against nobody); its files renamed to say so."""
        owner = holder_of(device)
        if owner is None:
            return
        renamed = []
        for file in record.files:
            name = file.name.replace(f"{HELD_PREFIX}{SHARED}-", f"{HELD_PREFIX}{owner}-", 1)
            with contextlib.suppress(FileNotFoundError):  # freed meanwhile
                os.rename(file, file.with_name(name))
            renamed.append(file.with_name(name))
        sync_folder(self.folder)
        record.files, record.owner = tuple(renamed), owner
        log.warning("%s: its held space is on uid %d's books", record.key, owner)

    def watch_tree(
        self, key: str, owner: int | None, folder: Path, open_now: Open | None = None
    ) -> None:
        """An evicted tree moved aside to ``folder``: its files open now, looked for
        before the delete starts (so they are on the books before the space it frees).
        A shared tree's is charged to the user whose processes hold the most of it."""
        if open_now is None:
            open_now = open_under(folder)
        known = {inode for r in self.records for inode in r.inodes}
        open_now = {k: v for k, v in open_now.items() if k not in known}
        if not open_now:
            return
        nbytes = sum(n for n, _, _ in open_now.values())
        if owner is None:
            by_uid: dict[int, int] = {}
            for n, _, uid in open_now.values():
                if uid not in (0, -1, os.geteuid()):
                    by_uid[uid] = by_uid.get(uid, 0) + n
            owner = max(by_uid, key=lambda uid: by_uid[uid]) if by_uid else None
        self._add(Record(key, owner, nbytes, folder=folder, inodes=set(open_now)))
        log.warning(
            "%s: %d bytes still held by %d open files of its deleted tree, on uid %s's "
            "books until they are closed",
            key,
            nbytes,
            len(open_now),
            SHARED if owner is None else owner,
        )

    def sweep(self) -> list[Record]:
        """Drop (and return) the records whose space is free now."""
        freed = []
        for record in self.records:
            if record.folder is not None:
                still = {
                    k: n for k, (n, _, _) in open_under(record.folder).items() if k in record.inodes
                }
                record.inodes, record.nbytes = set(still), sum(still.values())
                if still:
                    continue
            elif any(held_open(f) for f in record.files):
                continue
            else:
                for file in reversed(record.files):  # the blob after its image
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(file)
            freed.append(record)
            log.info("%s: the space its eviction left held is free now", record.key)
        gone = {id(r) for r in freed}
        with self._lock:
            self.records = [r for r in self.records if id(r) not in gone]
        return freed

    def recover(self, owner_of: Callable[[str], int | None]) -> None:
        """At a start: an earlier run's held images and its deleted trees' open files."""
        images: dict[str, list[Path]] = {}
        for child in sorted(self.folder.iterdir()):
            if child.name.startswith(HELD_PREFIX):
                images.setdefault(child.name.split(".", 1)[0], []).append(child)
        for stem, files in images.items():
            who, rest = stem[len(HELD_PREFIX) :].split("-", 1)
            key = rest.rsplit("-", 1)[0]
            owner = None if who == SHARED else int(who)
            nbytes = sum(f.stat().st_size for f in files)
            self._add(Record(key, owner, nbytes, files=tuple(files)))
        trees: dict[str, Open] = {}
        top = len(str(self.folder).rstrip("/")) + 1
        for inode, held in open_under(self.folder).items():
            name = held[1][top:].split("/", 1)[0]
            if name.startswith(DISCARDED_PREFIX):
                trees.setdefault(name, {})[inode] = held
        for name, open_now in trees.items():
            key = name[len(DISCARDED_PREFIX) :].rsplit("-", 1)[0]
            self.watch_tree(key, owner_of(key), self.folder / name, open_now)

    @staticmethod
    def is_held_image(name: str) -> bool:
        return name.startswith(HELD_PREFIX)
