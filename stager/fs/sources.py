"""Opening sources safely: confined to the allowed roots, never a special file.

- **Confinement.** With ``--allowed-root`` set, what is read lies under one of the
  roots, however it was reached (a link at any depth, a chain of links). The check is
  made on the object opened (``/proc/self/fd/N``), never on a path that could be
  swapped between a check and its use.
- **No special files.** A FIFO blocks its reader forever, and a device is not data:
  an ``O_PATH`` open runs no driver and waits on no writer; the real open follows only
  for a regular file, through the descriptor already checked.

Tree walks open each folder relative to its parent with ``O_NOFOLLOW``, so they need
these checks only at a link: :func:`follow` (and :func:`open_followed` into a folder
it led to).
"""

from __future__ import annotations

import errno
import os
import stat
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stager.core.errors import SourceNotFound, SourceUnreadable, SpecialSource, UnsafePath
from stager.fs.credentials import access, check_public

_PATH_FLAGS = os.O_PATH | os.O_CLOEXEC
READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY
_SPECIAL_KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}


def refuse_special(path: str, mode: int, skippable: bool = True) -> SpecialSource:
    """The sentence for a special file met in a source."""
    kind = _SPECIAL_KINDS.get(stat.S_IFMT(mode), "not a regular file")
    fix = (
        "remove it from the source, or set the step's special to 'skip' to leave it out"
        if skippable
        else "name a regular file instead"
    )
    return SpecialSource(
        f"source {path} is {kind}, which stager never reads (it could block forever or "
        f"is not data); {fix}"
    )


@dataclass(frozen=True)
class Roots:
    """The allowed source roots, resolved once; empty: anywhere the daemon can read."""

    real: tuple[str, ...] = ()

    @classmethod
    def of(cls, allowed_roots: Iterable[Path | str]) -> Roots:
        if isinstance(allowed_roots, Roots):
            return allowed_roots
        return cls(tuple(os.path.realpath(root) for root in allowed_roots))

    def __bool__(self) -> bool:
        return bool(self.real)

    def contains(self, real: str) -> bool:
        return not self.real or any(within(real, root) for root in self.real)

    def check(self, fd: int, shown: str) -> str:
        """The real path of what ``fd`` opened; UnsafePath when it is outside the roots."""
        real = fd_path(fd)
        if not self.contains(real):
            raise self.refusal(shown, real)
        return real

    def refusal(self, shown: str, real: str) -> UnsafePath:
        roots = ", ".join(self.real)
        return UnsafePath(
            f"source {shown} resolves to {real}, outside the allowed source roots "
            f"({roots}); remove or fix that link, or ask the admin to add its target "
            "to STAGER_ALLOWED_ROOTS"
        )


def within(real: str | None, top: str) -> bool:
    """``real`` is ``top`` or lies below it (both real paths); False for None."""
    return real is not None and (real == top or real.startswith(top.rstrip("/") + "/"))


def refuse_holding(real: str, written: str, shown: str) -> None:
    """Refuse a source folder at or above where a step writes (``written``), as ``cp -r``
    refuses to copy a folder into itself. ``real`` is its real path, ``shown`` its name."""
    if within(written, real):
        raise UnsafePath(
            f"source {shown} holds {written}, where this step writes: staging it would "
            "copy it into itself, a level deeper at each pass; stage a folder that does "
            "not hold it (or fix the link that leads to one), or put the cache elsewhere "
            "(STAGER_CACHE_DIR)"
        )


def _public(fd: int, shown: str, st: os.stat_result | None = None) -> int:
    """``fd``, once :func:`check_public` passed it; closed if not."""
    try:
        check_public(fd, shown, st)
    except BaseException:
        os.close(fd)
        raise
    return fd


def fd_path(fd: int) -> str:
    """The kernel's current name for what ``fd`` opened, every link resolved."""
    real = os.readlink(f"/proc/self/fd/{fd}")
    if real.endswith(" (deleted)") and not os.path.lexists(real):
        raise SourceNotFound(f"source {real[: -len(' (deleted)')]} was removed while opened")
    return real


def open_path(
    path: str, roots: Roots, dir_fd: int | None = None, shown: str | None = None
) -> tuple[int, os.stat_result]:
    """An ``O_PATH`` descriptor of what ``path`` resolves to (every link followed) and its
    stat; refused when it lies outside ``roots``. Opens no file: safe on a FIFO or device.
    ``shown`` names it in the refusal (``path`` is relative to ``dir_fd``)."""
    fd = access().open(path, _PATH_FLAGS, dir_fd=dir_fd)
    try:
        roots.check(fd, shown or path)
        return fd, os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise


def reopen(path_fd: int, flags: int = READ_FLAGS) -> int:
    """Open for real the very object an ``O_PATH`` descriptor names (no new lookup); the
    kernel checks the right to read it here, as for any open."""
    return access().reopen(path_fd, flags)


def open_source(path: str, allowed_roots: Iterable[Path | str] = ()) -> int:
    """An ``O_RDONLY`` descriptor of the regular file ``path`` resolves to.

    Refused with a sentence: a resolution outside ``allowed_roots`` (UnsafePath), or a
    FIFO, socket, device or folder (SpecialSource); OS errors (ENOENT, EACCES) propagate
    as ``OSError`` naming ``path``. The caller closes the descriptor.
    """
    roots = Roots.of(allowed_roots)
    fd, st = open_path(path, roots)
    try:
        if not stat.S_ISREG(st.st_mode):
            raise refuse_special(path, st.st_mode, skippable=False)
        opened = reopen(fd)
    finally:
        os.close(fd)
    return _public(opened, path, st)


def open_source_dir(path: str, allowed_roots: Iterable[Path | str] = ()) -> int:
    """An ``O_RDONLY | O_DIRECTORY`` descriptor of the folder ``path`` resolves to,
    confined like :func:`open_source`; NotADirectoryError for anything else."""
    roots = Roots.of(allowed_roots)
    fd = access().open(path, READ_FLAGS | os.O_DIRECTORY)
    try:
        roots.check(fd, path)
    except BaseException:
        os.close(fd)
        raise
    return _public(fd, path)


# -- walking a source tree ----------------------------------------------------------

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


@dataclass
class Folder:
    """A folder of a source tree, open. ``rel`` is its path below the walk's top ("" for
    the top); ``path`` names it for messages and for the processes that reopen it (they
    compare ``st``'s device and inode, so a folder swapped meanwhile is refused)."""

    fd: int
    path: str
    rel: str
    st: os.stat_result
    # A folder of a source (opened with the staging's reader's rights, see
    # stager.fs.credentials), not of a tree stager owns.
    source: bool = False

    def join(self, name: str) -> str:
        return f"{self.path}/{name}" if self.path != "/" else f"/{name}"

    def child_rel(self, name: str) -> str:
        return f"{self.rel}/{name}" if self.rel else name


def open_top(path: str, roots: Roots) -> Folder:
    """The top of a walk: ``path`` resolved (links followed) and confined."""
    fd = open_source_dir(path, roots)
    return Folder(fd, os.path.abspath(path), "", os.fstat(fd), source=True)


def open_top_unconfined(path: str) -> Folder:
    """The top of a walk of a tree stager owns: ``path`` itself, never through a link."""
    fd = os.open(path, DIR_FLAGS | os.O_NOFOLLOW)
    return Folder(fd, path, "", os.fstat(fd))


def open_child(folder: Folder, name: str) -> Folder:
    """A real sub-folder, opened relative to its parent and never through a link: a
    folder swapped for a link after the parent was listed fails (ELOOP/ENOTDIR)."""
    if not folder.source:
        fd = os.open(name, DIR_FLAGS | os.O_NOFOLLOW, dir_fd=folder.fd)
        return Folder(fd, folder.join(name), folder.child_rel(name), os.fstat(fd))
    fd = access().open(name, DIR_FLAGS | os.O_NOFOLLOW, dir_fd=folder.fd)
    st = os.fstat(fd)
    _public(fd, folder.join(name), st)
    return Folder(fd, folder.join(name), folder.child_rel(name), st, source=True)


@dataclass
class Target:
    """Where a link in a source tree leads: ``real`` is None for a dangling link."""

    text: str  # what the link says
    real: str | None
    st: os.stat_result | None


def follow(folder: Folder, name: str, roots: Roots) -> Target:
    """Resolve the link ``name`` in ``folder`` through any chain of links; refused
    (UnsafePath) when it leads outside ``roots``, dangling or not."""
    text = access().readlink(name, dir_fd=folder.fd)
    try:
        fd, st = open_path(name, roots, dir_fd=folder.fd, shown=folder.join(name))
    except OSError as exc:
        if exc.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
            raise
        # Dangling, or a loop of links: nothing to open, but where the text would
        # lead must stay inside all the same.
        real = access().realpath(folder.join(name))
        if roots and not roots.contains(real):
            raise roots.refusal(folder.join(name), real) from None
        return Target(text, None, None)
    try:
        return Target(text, fd_path(fd), st)
    finally:
        os.close(fd)


def leads_to_special(target: Target, shown: str, policy: str) -> bool:
    """A link to a FIFO, socket or device is one too: refused, or True to leave it out."""
    if target.st is None or stat.S_IFMT(target.st.st_mode) in (stat.S_IFREG, stat.S_IFDIR):
        return False
    if policy == "skip":
        return True
    raise refuse_special(shown, target.st.st_mode)


def open_followed(target: Target, shown: str) -> Folder:
    """A folder reached through a link, by its real path; refused if it changed since."""
    assert target.real is not None and target.st is not None
    fd = access().open(target.real, DIR_FLAGS | os.O_NOFOLLOW)
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != (target.st.st_dev, target.st.st_ino):
        os.close(fd)
        raise SourceNotFound(f"source {shown} changed while it was staged; stage again")
    return Folder(_public(fd, shown, st), target.real, "", st, source=True)


def enter_outside(target: Target, shown: str, open_ids: set[tuple[int, int]]) -> Folder | None:
    """A folder outside the tree reached by a link, unless it is one of the folders
    being walked already (``open_ids``: a cycle of links): that one is left empty."""
    assert target.st is not None
    if (target.st.st_dev, target.st.st_ino) in open_ids:
        return None
    return open_followed(target, shown)


class Visitor:
    """What a walk calls for each thing it finds; ops override what they need.

    ``subdir`` and ``link`` return the folder to walk into next, or None to stay.
    """

    def file(self, folder: Folder, entry: os.DirEntry[str]) -> None:
        pass

    def subdir(self, folder: Folder, entry: os.DirEntry[str]) -> Folder | None:
        return open_child(folder, entry.name)

    def link(self, folder: Folder, entry: os.DirEntry[str]) -> Folder | None:
        return None

    def special(self, folder: Folder, entry: os.DirEntry[str]) -> None:
        pass

    def leave(self, folder: Folder) -> None:
        pass


def listing(folder: Folder) -> Any:
    """The entries of ``folder``, as ``os.scandir`` gives them: a source folder's listed
    (and each entry's lstat taken) by whoever reads sources here, a tree stager owns
    by this process."""
    return access().scandir(folder.fd) if folder.source else os.scandir(folder.fd)


def walk(top: Folder, visitor: Visitor, special: str = "refuse", check: object = None) -> None:
    """Depth-first over ``top``, one open listing per level, never a list of the tree's
    files; each folder opened relative to its parent. Special files are refused or
    passed to ``visitor.special`` (``"skip"``), never opened. ``check`` runs per folder."""
    stack = [(top, listing(top))]
    try:
        while stack:
            folder, entries = stack[-1]
            child = None
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    child = visitor.subdir(folder, entry)
                elif entry.is_file(follow_symlinks=False):
                    visitor.file(folder, entry)
                    continue
                elif entry.is_symlink():
                    child = visitor.link(folder, entry)
                elif special == "skip":
                    visitor.special(folder, entry)
                    continue
                else:
                    shown = folder.join(entry.name)
                    raise refuse_special(shown, entry.stat(follow_symlinks=False).st_mode)
                if child is not None:
                    if check is not None:
                        check()  # type: ignore[operator]
                    stack.append((child, listing(child)))
                    break
            if child is None:
                entries.close()
                stack.pop()
                visitor.leave(folder)
                if folder is not top:
                    os.close(folder.fd)
    finally:
        for folder, entries in stack:
            entries.close()
            if folder is not top:
                os.close(folder.fd)


def walk_until(top: Folder, visitor: Visitor, special: str, deadline: float) -> bool:
    """:func:`walk`, stopped at the ``time.monotonic()`` ``deadline`` (a request-time
    check's budget); whether it walked the whole tree."""

    def in_budget() -> None:
        if time.monotonic() > deadline:
            raise _OverBudget

    try:
        walk(top, visitor, special, check=in_budget)
    except _OverBudget:
        return False
    return True


class _OverBudget(Exception):
    pass


def require_source(path: str, what: str = "source") -> Path:
    """Fail with a sentence naming the path when a source is missing or unreadable:
    decided by opening it as whoever reads sources here, whatever its mode says."""
    try:
        fd, st = open_path(path, Roots())
    except FileNotFoundError:
        raise SourceNotFound(
            f"{what} {path} does not exist; check the path in the request"
        ) from None
    except PermissionError:
        raise _unreadable(what, path) from None
    try:
        if stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode):
            os.close(reopen(fd, READ_FLAGS))
    except PermissionError:
        raise _unreadable(what, path) from None
    finally:
        os.close(fd)
    return Path(path)


def _unreadable(what: str, path: str) -> SourceUnreadable:
    return SourceUnreadable(
        f"{what} {path} is not readable by the user who asked for it (the kernel refused "
        "to open it); fix its permissions, or stage it as a user who may read it"
    )
