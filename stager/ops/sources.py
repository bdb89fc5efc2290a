"""Opening sources safely: confined to the allowed roots, never a special file.

Two promises hold for everything stager reads from a source:

- **Confinement.** With ``--allowed-root`` set, what is read lies under one of the
  roots, however it was reached: a link at any depth of a tree, a chain of links,
  an archive named through a link. The check is made on the object that was
  opened (the kernel's own name for the descriptor, ``/proc/self/fd/N``), never on
  a path that could be swapped between a check and its use.
- **No special files.** A FIFO, socket or device is never opened for reading: a
  FIFO blocks its reader forever, and a device is not data. Opening with
  ``O_PATH`` first runs no driver and waits on no writer; the real open follows
  only for a regular file, and goes through the descriptor already checked.

Tree walks (copy, symlink tree, their size estimates) open each folder relative to
its parent's descriptor with ``O_NOFOLLOW``, so they need these checks only where a
tree holds a link; :func:`open_link` is that step.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from stager.errors import SourceNotFound, SpecialSource, UnsafePath

_PATH_FLAGS = os.O_PATH | os.O_CLOEXEC
READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY
_SPECIAL_KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}


def special_kind(mode: int) -> str | None:
    """ "a FIFO", "a socket", ... for a special file's ``st_mode``; None for files,
    folders and links."""
    return _SPECIAL_KINDS.get(stat.S_IFMT(mode))


def refuse_special(path: str, mode: int, skippable: bool = True) -> SpecialSource:
    """The sentence for a special file met in a source."""
    kind = special_kind(mode) or "not a regular file"
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
        return not self.real or any(
            real == root or real.startswith(root.rstrip("/") + "/") for root in self.real
        )

    def check(self, fd: int, shown: str) -> str:
        """The real path of what ``fd`` opened; UnsafePath when it is outside the roots."""
        real = fd_path(fd)
        if not self.contains(real):
            roots = ", ".join(self.real)
            raise UnsafePath(
                f"source {shown} resolves to {real}, outside the allowed source roots "
                f"({roots}); remove or fix that link, or ask the admin to add its target "
                "to STAGER_ALLOWED_ROOTS"
            )
        return real


def fd_path(fd: int) -> str:
    """The kernel's current name for what ``fd`` opened, every link resolved."""
    real = os.readlink(f"/proc/self/fd/{fd}")
    if real.endswith(" (deleted)") and not os.path.lexists(real):
        raise SourceNotFound(f"source {real[: -len(' (deleted)')]} was removed while opened")
    return real


def open_path(path: str, roots: Roots, dir_fd: int | None = None) -> tuple[int, os.stat_result]:
    """An ``O_PATH`` descriptor of what ``path`` resolves to (every link followed) and its
    stat; refused when it lies outside ``roots``. Opens no file: safe on a FIFO or device."""
    fd = os.open(path, _PATH_FLAGS, dir_fd=dir_fd)
    try:
        roots.check(fd, path)
        return fd, os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise


def reopen(path_fd: int, flags: int = READ_FLAGS) -> int:
    """Open for real the very object an ``O_PATH`` descriptor names (no new lookup)."""
    return os.open(f"/proc/self/fd/{path_fd}", flags)


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
        return reopen(fd)
    finally:
        os.close(fd)


def open_source_dir(path: str, allowed_roots: Iterable[Path | str] = ()) -> int:
    """An ``O_RDONLY | O_DIRECTORY`` descriptor of the folder ``path`` resolves to,
    confined like :func:`open_source`; NotADirectoryError for anything else."""
    roots = Roots.of(allowed_roots)
    fd = os.open(path, READ_FLAGS | os.O_DIRECTORY)
    try:
        roots.check(fd, path)
        return fd
    except BaseException:
        os.close(fd)
        raise
