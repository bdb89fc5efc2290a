"""Filesystem side of an entry's life: an attempt's folder, atomic publish, links,
removal. :mod:`stager.lifecycle` decides when each runs.

All functions block: the daemon calls them through ``run_io``, the staging
process directly. The rename of an attempt's tree to ``data/<key>`` is the
commit point: a directory under ``data/`` is complete by construction, whatever
happens to the process afterwards.
"""

from __future__ import annotations

import errno
import os
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

# Evicted trees and the partial data of failed stagings wait under ``partial/`` with
# this prefix until they are deleted; a daemon that stops first deletes them at start.
DISCARDED_PREFIX = "discarded-"


class StopFlag(Protocol):
    def is_set(self) -> bool: ...


@dataclass(frozen=True)
class Attempt:
    """One attempt's folder, ``partial/<key>.<attempt>``: data and bookkeeping together."""

    root: Path

    @property
    def tree(self) -> Path:
        """The dataset being built; renamed to ``data/<key>`` when complete."""
        return self.root / "tree"

    @property
    def marker(self) -> Path:
        """How many steps completed, for resuming this attempt (and no other)."""
        return self.root / "steps-done"

    def steps_done(self) -> int:
        try:
            return int(self.marker.read_text() or 0)
        except FileNotFoundError:
            return 0


def publish(tree: Path, final: Path) -> None:
    os.rename(tree, final)
    # Make the rename itself durable before the state store says "ready".
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, text: str) -> None:
    """Replace ``path`` whole: after a crash it holds the old text or the new, durably."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)


def tree_size(root: Path) -> int:
    """Bytes on disk under root (files and link entries, not what links point to)."""
    total = 0
    stack = [root]
    while stack:
        with os.scandir(stack.pop()) as it:
            for item in it:
                if item.is_dir(follow_symlinks=False):
                    stack.append(Path(item.path))
                else:
                    total += item.stat(follow_symlinks=False).st_size
    return total


def discard(path: Path, trash_dir: Path) -> Path | None:
    """Move ``path`` aside in one rename, to be deleted at leisure: for a published tree
    the commit point of its eviction (a tree under ``data/`` is whole, or gone); for
    partial data, its name is free for a new staging at once. Returns where it went, or
    None if it was already gone."""
    trash = trash_dir / f"{DISCARDED_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}"
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return None
    return trash


def delete_tree(path: Path, stop: StopFlag | threading.Event) -> bool:
    """Delete ``path`` bottom-up, giving up as soon as ``stop`` is set (the daemon is
    stopping: a million-file tree must not hold up its exit). True once it is all gone;
    what is left of a stopped one is an orphan the next start removes."""
    if os.path.islink(path) or not os.path.isdir(path):
        if os.path.lexists(path):
            os.unlink(path)
        return True
    for dirpath, dirnames, filenames in os.walk(path, topdown=False):
        for name in filenames:
            if stop.is_set():
                return False
            os.unlink(os.path.join(dirpath, name))
        for name in dirnames:  # emptied already, or links to folders (never followed)
            child = os.path.join(dirpath, name)
            if os.path.islink(child):
                os.unlink(child)
            else:
                os.rmdir(child)
    if os.path.lexists(path):
        os.rmdir(path)
    return True


def make_link(link: Path, target: Path) -> None:
    """Point ``link`` at ``target``, replacing an old symlink atomically."""
    link.parent.mkdir(parents=True, exist_ok=True)
    tmp = link.with_name(f".{link.name}.stager-tmp")
    if tmp.is_symlink():
        tmp.unlink()
    os.symlink(target, tmp)
    os.replace(tmp, link)


def remove_link(link: Path, target: Path) -> None:
    """Remove ``link`` only if it still points at ``target`` (never someone else's link)."""
    try:
        if link.is_symlink() and Path(os.readlink(link)) == target:
            link.unlink()
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            raise
