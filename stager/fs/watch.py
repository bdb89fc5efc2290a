"""Knowing, without walking it, that a published tree has not changed since its last
full check: every folder of the tree watched with inotify.

Checking the seal (:mod:`stager.fs.seal`) costs O(files) at every hit: 55 ms at
20,000 files, seconds at a million. A watch on a folder reports every change to it
and to what it holds, so a tree checked whole with its folders watched, and no change
reported since, is still what was checked.

The order makes it sound: the folders are watched first (:meth:`TreeWatch.arm`), then
the tree is checked whole, then the check is confirmed (:meth:`TreeWatch.confirm`)
only if no change was reported since the arm. Anything the watch cannot promise (a
watch that cannot be added, a queue overflow, a folder removed or moved, a restart)
makes the tree unknown, and the next hit checks it whole again. A hit reads the
events without blocking (:meth:`TreeWatch.clean`) and checks that the tree's top is
still the folder watched.

What no folder watch reports: a write through a hard link made from outside the tree,
through a shared writable mapping, or a mount over a folder. Only the cache's owner
(root in the node service) can do these; the first hit after a restart checks every
tree whole.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from inotify_simple import INotify, flags

log = logging.getLogger("stager.watch")

# What changes a tree; reads and opens do not count. ONLYDIR and DONT_FOLLOW: only the
# folders themselves are watched, never what a link points at.
CHANGES = (
    flags.MODIFY
    | flags.ATTRIB
    | flags.CLOSE_WRITE
    | flags.CREATE
    | flags.DELETE
    | flags.MOVED_FROM
    | flags.MOVED_TO
    | flags.DELETE_SELF
    | flags.MOVE_SELF
    | flags.ONLYDIR
    | flags.DONT_FOLLOW
)


class TreeWatch:
    """The published trees whose folders are watched, by cache key."""

    def __init__(self) -> None:
        try:
            self._inotify: INotify | None = INotify(nonblocking=True)
        except OSError as exc:  # no inotify here: every hit checks its tree whole
            log.warning("inotify is not available (%s); every hit checks its tree whole", exc)
            self._inotify = None
        self._lock = threading.Lock()  # arm runs on a thread, the rest on the event loop
        self._key_of: dict[int, str] = {}  # watch descriptor -> cache key
        self._watches: dict[str, list[int]] = {}  # cache key -> its folders' watches
        self._changes: dict[str, int] = {}  # changes reported per key since it was armed
        self._clean: set[str] = set()  # checked whole, unchanged since
        # The top folder each key's watches are on, by (device, inode): a tree put in its
        # place by renaming a folder above it (which no watch of the tree sees) is not it.
        self._tops: dict[str, tuple[int, int]] = {}

    def clean(self, key: str, root: Path) -> bool:
        """Whether the tree of ``key`` at ``root`` is known unchanged since its last full
        check (one ``lstat`` of the top besides the queue's read)."""
        self._drain()
        if key not in self._clean:
            return False
        try:
            top = os.lstat(root)
        except OSError:
            return False
        return self._tops.get(key) == (top.st_dev, top.st_ino)

    def arm(self, key: str, root: Path) -> int | None:
        """Watch every folder of ``root`` unless they are watched already (blocking:
        lists the tree); a token for :meth:`confirm`, or None when the tree cannot be
        watched whole."""
        if self._inotify is None:
            return None
        with self._lock:
            if key in self._watches:
                return self._changes[key]
        added: list[int] = []
        try:
            top = os.lstat(root)
            for folder, _, _ in os.walk(root, onerror=_raise):
                added.append(self._inotify.add_watch(folder, CHANGES))
        except OSError as exc:
            # The kernel's limit (ENOSPC) or a folder gone meanwhile: not watched, so
            # every hit checks the tree whole, as without a watch.
            log.info("not watching %s (%s): its hits check it whole", root, exc)
            for wd in added:
                self._remove(wd)
            return None
        with self._lock:
            self._tops[key] = (top.st_dev, top.st_ino)
            self._watches.setdefault(key, []).extend(added)
            for wd in added:
                self._key_of[wd] = key
            return self._changes.setdefault(key, 0)

    def confirm(self, key: str, token: int | None) -> None:
        """The tree of ``key``, armed with ``token``, was then checked whole and found
        unchanged: it stays known unchanged until a change is reported."""
        self._drain()
        with self._lock:
            if token is not None and self._changes.get(key) == token and key in self._watches:
                self._clean.add(key)

    def forget(self, key: str) -> None:
        """Stop watching ``key``'s tree (changed, or gone)."""
        with self._lock:
            wds = self._unwatch(key)
        for wd in wds:
            self._remove(wd)

    def _unwatch(self, key: str) -> list[int]:
        """(Under the lock.) ``key`` is watched no more; the watches to remove."""
        self._clean.discard(key)
        self._changes.pop(key, None)
        self._tops.pop(key, None)
        wds = self._watches.pop(key, [])
        for wd in wds:
            self._key_of.pop(wd, None)
        return wds

    def close(self) -> None:
        if self._inotify is not None:
            self._inotify.close()
            self._inotify = None

    def _remove(self, wd: int) -> None:
        assert self._inotify is not None
        try:
            self._inotify.rm_watch(wd)
        except OSError:
            pass  # removed by the kernel already (its folder is gone)

    def _drain(self) -> None:
        """Take every reported change off the queue (non-blocking)."""
        if self._inotify is None:
            return
        try:
            events = self._inotify.read(timeout=0)
        except BlockingIOError:
            return
        stale: list[int] = []
        with self._lock:
            for event in events:
                if event.mask & flags.Q_OVERFLOW:  # changes were lost: nothing is known
                    self._clean.clear()
                    for key in self._changes:
                        self._changes[key] += 1
                    continue
                key = self._key_of.get(event.wd)
                if key is None:
                    continue
                self._clean.discard(key)
                self._changes[key] += 1
                if event.mask & (flags.IGNORED | flags.DELETE_SELF | flags.MOVE_SELF):
                    # A folder of the tree is gone or moved (an eviction moves the whole
                    # tree away): the next hit finds a tree to watch anew.
                    stale += self._unwatch(key)
        for wd in stale:
            self._remove(wd)


def _raise(exc: OSError) -> None:
    raise exc
