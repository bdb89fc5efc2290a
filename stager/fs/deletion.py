"""Deleting a tree stager owns (an evicted dataset, a failed attempt, an archive a step
used up): at ``rm -rf`` speed or better, without holding the daemon, and stoppable.
Only trees no user may write come here (a user's own folder is emptied by the user's
process: stager.staging.publish.empty_own_folder); each piece is reached from a folder
held open, never through a link.

The tree's top folders go to one ``rm -rf`` per core (why: docs/performance.md,
"Delete"), and a stop kills them at once (what is left is an orphan the next start
removes). Small or flat trees, machines without ``rm``, and what ``rm`` left (a
read-only folder) are deleted here, one ``unlinkat`` per file relative to its
folder's descriptor.
"""

from __future__ import annotations

import errno
import os
import shutil
import threading
from pathlib import Path
from typing import Protocol

from stager.core.processes import exited, spawn
from stager.fs.sources import DIR_FLAGS, Folder, Visitor, open_top_unconfined, walk

RM = shutil.which("rm")
# A folder with more entries than this is not split further (and its listing is
# not kept): a flat million-file folder goes to one process whole.
SPLIT_MAX_ENTRIES = 8192
# Trees with fewer top-level pieces than this are deleted here: starting processes
# costs more than it saves.
SPLIT_MIN_PIECES = 16
POLL_S = 0.05


class StopFlag(Protocol):
    def is_set(self) -> bool: ...


def delete_tree(path: Path | str, stop: StopFlag | threading.Event) -> bool:
    """Delete ``path`` (a folder, bottom-up; a file or link, itself: links are never
    followed), giving up as soon as ``stop`` is set. True once it is all gone."""
    path = str(path)
    try:
        top = open_top_unconfined(path)
    except FileNotFoundError:
        return True
    except OSError as exc:
        if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
            raise
        os.unlink(path)  # a file, or a link (even to a folder)
        return True
    try:
        if stop.is_set():
            return False
        pieces = _split(top)
        if RM is not None and len(pieces) >= SPLIT_MIN_PIECES:
            if not _delete_with_rm(top.fd, pieces, stop):
                return False
        # What is left: the folders above the pieces, or everything when not split, or
        # whatever rm could not remove (a read-only folder as a non-root user).
        walk(top, _Deleter(stop), special="skip", check=lambda: _check_stop(stop))
    except _Stopped:
        return False
    finally:
        os.close(top.fd)
    os.rmdir(path)
    return True


def _split(top: Folder) -> list[str]:
    """The tree's pieces for parallel deletion, relative to its top: the entries of its
    top folders, going down through levels with few folders (``train/``, ``val/``), up
    to three, each listed through the folder above it, never through a link."""
    pieces: list[str] = []
    frontier = ["."]
    for _ in range(3):
        below: list[str] = []
        for folder in frontier:
            entries = _small_listing(top.fd, folder)
            if entries is None:
                return []  # too many to split: deleted whole
            for name, is_dir in entries:
                (below if is_dir else pieces).append(os.path.normpath(f"{folder}/{name}"))
        if len(below) >= SPLIT_MIN_PIECES or not below:
            return pieces + below
        frontier = below
    return pieces + frontier


def _small_listing(top: int, folder: str) -> list[tuple[str, bool]] | None:
    fd = os.open(folder, DIR_FLAGS | os.O_NOFOLLOW, dir_fd=top)
    out = []
    try:
        with os.scandir(fd) as entries:
            for entry in entries:
                if len(out) >= SPLIT_MAX_ENTRIES:
                    return None
                out.append((entry.name, entry.is_dir(follow_symlinks=False)))
    finally:
        os.close(fd)
    return out


def _delete_with_rm(top: int, pieces: list[str], stop: StopFlag | threading.Event) -> bool:
    """One ``rm -rf`` per core over interleaved shares of ``pieces`` (relative to the
    folder ``top`` holds open: each rm works in that very folder, whatever its path
    names meanwhile); False if stopped."""
    cores = max(1, min(len(os.sched_getaffinity(0)), 4))
    processes = [
        spawn(  # a failure shows as what is left, deleted here
            [str(RM), "-rf", "--one-file-system", "--", *pieces[i::cores]],
            cwd=f"/proc/self/fd/{top}",  # in the child: the descriptor it inherits
            pass_fds=(top,),
        )
        for i in range(cores)
    ]
    try:
        for process in processes:
            while not exited(process, POLL_S):
                if stop.is_set():
                    return False
        return True
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()


class _Stopped(Exception):
    pass


def _check_stop(stop: StopFlag | threading.Event) -> None:
    if stop.is_set():
        raise _Stopped


class _Deleter(Visitor):
    # How many files between two looks at ``stop`` (a flat million-file folder).
    CHECK_EVERY = 4096

    def __init__(self, stop: StopFlag | threading.Event) -> None:
        self.stop = stop
        self.count = 0

    def file(self, folder: Folder, entry: os.DirEntry[str]) -> None:
        try:
            os.unlink(entry.name, dir_fd=folder.fd)
        except PermissionError:
            os.chmod(folder.fd, 0o700)  # a read-only folder (not ours to keep): open it up
            os.unlink(entry.name, dir_fd=folder.fd)
        self.count += 1
        if self.count % self.CHECK_EVERY == 0:
            _check_stop(self.stop)

    link = special = file  # type: ignore[assignment]  # never followed, never opened

    def leave(self, folder: Folder) -> None:
        if folder.rel:
            os.rmdir(folder.path)
