"""The sizes of trees: a tree stager owns, and a source tree before it is copied.

A tree stager owns is counted as it lies on disk (:func:`sum_sizes`): files, links
and special files, not folders, never following a link (:mod:`stager.fs.seal` counts
a finished tree so). A source tree is counted as ``copy`` will write it
(:func:`copy_estimate`): links inside as links, links out of it followed, within a
time budget.
"""

from __future__ import annotations

import os
import stat

from stager.fs.sources import (
    Folder,
    Roots,
    Visitor,
    enter_outside,
    follow,
    leads_to_special,
    open_child,
    open_top,
    open_top_unconfined,
    walk,
    walk_until,
    within,
)
from stager.wire.progress import ProgressSink, report_written

# What a staging's write bound charges for a name beyond its content: a folder takes a
# block of its own on a disk filesystem (ext4, xfs: 4 KiB at least), every name an entry
# in its folder's blocks (ext4: 8 bytes and the name), charged as ``ENTRY_BYTES`` and the
# name's whole relative path: never less than the disk uses, and it pays for the path
# the staging keeps in memory.
FOLDER_BYTES = 4096
ENTRY_BYTES = 12


def entry_bytes(rel: str) -> int:
    """The charge for one new name at the relative path ``rel`` (its folder's entry)."""
    return ENTRY_BYTES + len(rel)


class NameCharge:
    """The names a tree walker makes, charged to a staging's bounds a batch at a time
    (a lock and a limit check per file would cost a million-file copy), before they are
    made, so a bound stops the walk before it passes."""

    EVERY = 256  # names: at most this many are made before they are charged

    def __init__(self, sink: ProgressSink) -> None:
        self.sink = sink
        self.nbytes = self.inodes = 0

    def folder(self, rel: str) -> None:
        """A folder made at ``rel``: its block, its entry, its inode."""
        self.nbytes += FOLDER_BYTES + entry_bytes(rel)
        self.inodes += 1
        if self.inodes >= self.EVERY:
            self.flush()

    def names(self, rel: str, count: int, chars: int) -> None:
        """``count`` files or links made in the folder ``rel``, their names ``chars``
        characters together."""
        self.nbytes += count * (ENTRY_BYTES + len(rel) + 1) + chars
        self.inodes += count
        if self.inodes >= self.EVERY:
            self.flush()

    def flush(self) -> None:
        nbytes, inodes = self.nbytes, self.inodes
        self.nbytes = self.inodes = 0
        report_written(self.sink, nbytes, inodes)


class _Sizes(Visitor):
    """Sums every entry as itself (a link by its length)."""

    def __init__(self) -> None:
        self.total = 0

    def file(self, folder: Folder, entry: os.DirEntry[str]) -> None:
        self.total += entry.stat(follow_symlinks=False).st_size

    link = special = file  # type: ignore[assignment]  # the entry itself


def sum_sizes(path: str) -> int:
    """Bytes of every entry under the tree stager owns at ``path`` (files, and links
    and special files as themselves): one ``fstatat`` each, nothing kept."""
    top = open_top_unconfined(path)
    try:
        sizes = _Sizes()
        walk(top, sizes, special="skip")
        return sizes.total
    finally:
        os.close(top.fd)


# -- a source tree, as a copy will write it --------------------------------------------


def copy_estimate(path: str, roots: Roots, special: str, deadline: float) -> int:
    """The bytes a ``copy`` of the folder ``path`` will write, walked until the
    ``time.monotonic()`` ``deadline`` (special files and links out of ``roots`` refused,
    as the copy refuses them); past it, the walked part of the top folder is scaled up
    to all of it."""
    return _CopySizes(roots, special, deadline).run(path)


class _CopySizes(Visitor):
    """Sums file sizes the way the copy walks (links followed out of the tree)."""

    def __init__(self, roots: Roots, special: str, deadline: float) -> None:
        self.roots, self.policy, self.deadline = roots, special, deadline
        self.total = 0
        self.top_real = ""
        self.open_ids: set[tuple[int, int]] = set()
        # For the estimate past the budget: top-level entries walked whole, and the
        # bytes they held.
        self.top_done = 0
        self.top_bytes = 0

    def run(self, path: str) -> int:
        top = open_top(path, self.roots)
        self.top_real = os.readlink(f"/proc/self/fd/{top.fd}")
        try:
            self.open_ids.add((top.st.st_dev, top.st.st_ino))
            if walk_until(top, self, self.policy, self.deadline):
                return self.total
            with os.scandir(top.fd) as entries:
                top_entries = sum(1 for _ in entries)
            return self.top_bytes * top_entries // self.top_done if self.top_done else 0
        finally:
            os.close(top.fd)

    def _top_entry_done(self, folder: Folder) -> None:
        if not folder.rel:
            self.top_done += 1
            self.top_bytes = self.total

    def file(self, folder: Folder, entry: os.DirEntry[str]) -> None:
        self.total += entry.stat(follow_symlinks=False).st_size
        self._top_entry_done(folder)

    def subdir(self, folder: Folder, entry: os.DirEntry[str]) -> Folder | None:
        child = open_child(folder, entry.name)
        self.open_ids.add((child.st.st_dev, child.st.st_ino))
        return child

    def link(self, folder: Folder, entry: os.DirEntry[str]) -> Folder | None:
        target = follow(folder, entry.name, self.roots)
        shown = folder.join(entry.name)
        child = None
        if leads_to_special(target, shown, self.policy) or target.st is None:
            pass  # left out, or kept as a (dangling) link: no data
        elif within(target.real, self.top_real):
            pass  # kept as a link
        elif stat.S_ISDIR(target.st.st_mode):
            child = enter_outside(target, shown, self.open_ids)
            if child is not None:
                child.rel = folder.child_rel(entry.name)
                self.open_ids.add((child.st.st_dev, child.st.st_ino))
        else:
            self.total += target.st.st_size
        if child is None:
            self._top_entry_done(folder)
        return child

    def leave(self, folder: Folder) -> None:
        self.open_ids.discard((folder.st.st_dev, folder.st.st_ino))
        if folder.rel and "/" not in folder.rel:
            self.top_done += 1
            self.top_bytes = self.total
