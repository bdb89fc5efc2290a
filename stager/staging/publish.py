"""Filesystem side of an entry's life: an attempt's folder, atomic publish, links,
removal. :mod:`stager.engine.lifecycle` decides when each runs.

All functions block: the daemon calls them through ``run_io``, the staging
process directly. The rename of an attempt's tree to ``data/<key>`` is the
commit point: a directory under ``data/`` is complete by construction, whatever
happens to the process afterwards.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stager.core.errors import StagerError, UserProcessUnanswered
from stager.fs.seal import open_up_top

# Evicted trees and the partial data of failed stagings wait under ``partial/`` with
# this prefix until they are deleted; a daemon that stops first deletes them at start.
DISCARDED_PREFIX = "discarded-"

log = logging.getLogger("stager.staging.publish")


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

    def set_aside(self, index: int) -> Path:
        """Where step ``index``'s used-up input (an extracted download) is moved out of
        the tree: removed with this folder once the tree is published, or discarded."""
        return self.root / f"used-up-{index}"

    def steps_done(self) -> int:
        try:
            return int(self.marker.read_text() or 0)
        except FileNotFoundError:
            return 0


def write_atomically(path: Path, text: str) -> None:
    """Replace ``path`` whole: after a crash it holds the old text or the new, durably."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)


def discard(path: Path, trash_dir: Path) -> Path | None:
    """Move ``path`` aside in one rename, to be deleted at leisure (for a published tree,
    its eviction's commit point); returns where it went, or None if it was gone."""
    trash = trash_dir / f"{DISCARDED_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}"
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return None
    except PermissionError:
        # A published tree's top is read-only (stager.fs.seal), and a folder moved to a
        # new parent must be writable by a mover who is not root.
        open_up_top(path)
        os.rename(path, trash)
    return trash


def make_link(link: Path, target: Path) -> None:
    """Point ``link`` at ``target``, replacing an old symlink atomically. Made on every
    request for a linked dataset, so a link already right is left alone."""
    try:
        if os.readlink(link) == str(target):
            return
    except OSError:
        pass  # missing, or not a link: made (or refused) below
    link.parent.mkdir(parents=True, exist_ok=True)
    tmp = link.with_name(f".{link.name}.stager-tmp")
    if tmp.is_symlink():
        tmp.unlink()
    os.symlink(target, tmp)
    os.replace(tmp, link)


def empty_own_folder(path: Path) -> None:
    """Delete what a folder the calling user may write holds (a delivery), in that
    user's own process: whatever they make of it meanwhile, the worst is deleting their
    own files. The folder itself stays, for the service to remove (:func:`remove_emptied`)."""

    def open_up(function: object, failed: str, excinfo: object) -> None:
        parent = os.path.dirname(failed)
        try:
            os.chmod(parent, 0o700)
            if function in (os.rmdir, os.unlink):
                function(failed)  # type: ignore[operator]
                return
        except OSError:
            pass
        raise excinfo[1]  # type: ignore[index]

    try:
        entries = os.listdir(path)
    except FileNotFoundError:
        return
    for name in entries:
        inner = os.path.join(path, name)
        # The user may change what a name is while this runs: whatever it is at the
        # moment of each call is what goes (never followed), and a name gone already
        # is fine.
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            if os.path.isdir(inner) and not os.path.islink(inner):
                shutil.rmtree(inner, onerror=open_up)
            else:
                os.unlink(inner)


def remove_emptied(path: Path) -> bool:
    """Remove a folder its user has emptied (:func:`empty_own_folder`), as the service:
    ``rmdir`` follows no link and removes nothing but an empty folder. False if the user
    put something in it meanwhile."""
    try:
        os.rmdir(path)
    except FileNotFoundError:
        return True
    except OSError as exc:
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
            return False
        raise
    return True


async def remove_delivery(as_user: Any, owner: int | None, folder: Path) -> None:
    """A delivery's folder, gone: emptied by its owner's process, then removed by the
    service; tried twice, and what still stays is left for the next start."""
    for _ in range(3):
        try:
            await as_user(owner, empty_own_folder, folder)
            if await as_user(None, remove_emptied, folder):  # None: as the service
                return
        except UserProcessUnanswered:
            raise  # their process is stopped or gone: the caller moves on to other owners
        except (OSError, StagerError) as exc:  # a race the user runs against it
            log.warning("could not remove delivery %s yet: %s", folder, exc)
    log.warning("delivery %s is refilled as it is deleted; left for the next start", folder)


def remove_link(link: Path, target: Path) -> None:
    """Remove ``link`` only if it still points at ``target`` (never someone else's link)."""
    try:
        if link.is_symlink() and Path(os.readlink(link)) == target:
            link.unlink()
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            raise
