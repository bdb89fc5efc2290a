"""Copying files so that a change in the source is caught and a restart can trust what
is there; the per-file half of the ``copy`` op (its walk is :mod:`stager.ops.copy`).

- Seven system calls a file (docs/performance.md); the source is opened
  ``O_NOFOLLOW | O_NONBLOCK`` (a file swapped for a link or a FIFO is refused, never
  waited on), the destination ``O_CREAT | O_EXCL``; the walk's ``fstatat`` is the
  "before" of the check.
- Data moves by the chain of :mod:`stager.fs.fastcopy`, in ``CHUNK`` pieces so
  progress and cancel are seen within a large file.
- After the bytes moved, ``fstat`` of the source must show the size, mtime, ctime
  and inode the walk saw; if not, the file is copied once more, and a second change
  fails the staging naming the file. ``verify: sha256`` also compares digests.
- Restartable without a journal: the mtime is set last, so "same size and mtime as
  the source" means complete. Only a file already there (a resumed staging) is
  compared, and kept or replaced.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from stager.core.errors import VerifyFailed
from stager.fs import forked
from stager.fs.credentials import access, check_public, source_reader
from stager.fs.fastcopy import copy_chunk
from stager.fs.seal import FILE_MODE
from stager.fs.sources import Roots, open_source, refuse_special
from stager.rights.gateway import DIRECT
from stager.wire.progress import ProgressSink, report_written

# Big enough that a multi-GB file costs few syscalls, small enough that cancel
# and progress stay responsive (one check per chunk).
CHUNK = 64 * 1024 * 1024
READ_CHUNK = 1024 * 1024  # of a file read back for its digest

_SOURCE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_CREATE_FLAGS = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class CopyContext(Protocol):
    """What a single file's copy needs of the op's context (an ``OpContext`` is one)."""

    verify: str
    progress: ProgressSink

    def check_cancelled(self) -> None: ...


def copy_file(path_fd: int, source: str, target: str, ctx: CopyContext, roots: Roots) -> int:
    """The file ``path_fd`` (an ``O_PATH`` descriptor of ``source``) to ``target``, on
    this process, with progress and cancel seen within it; returns its size as copied."""
    st = os.fstat(path_fd)
    ctx.progress.add_total(st.st_size, 1)
    folder, name = os.path.split(target)
    dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    made: list[int] = []
    try:
        if _is_complete(dfd, name, st.st_size, st.st_mtime_ns):
            ctx.progress.advance(st.st_size, 1)
            return st.st_size

        def count(nbytes: int) -> None:
            made.append(nbytes)
            report_written(ctx.progress, nbytes)

        job = FileCopier(ctx.verify, ctx.progress.advance, ctx.check_cancelled, count)
        # Opened by name again: a retry must see what the name holds now.
        job.copy_checked(lambda: open_source(source, roots), source, dfd, name, again=True)
    finally:
        os.close(dfd)
    ctx.progress.advance(0, 1)
    return sum(made)


class Stopped(Exception):
    """The op is stopping (failed elsewhere, or cancelled): leave this file unfinished."""


@dataclass
class FileCopier:
    """How files are copied in one process: the verify level, where progress goes,
    what says stop (raising :class:`Stopped` on a worker, ``Cancelled`` on the op's
    own process), and where the bytes of each finished file are counted."""

    verify: str
    advance: Callable[[int], Any]
    check_stop: Callable[[], None]
    made: Callable[[int], Any]  # the bytes of each file finished, as it is in the tree

    def copy_group(
        self, sfd: int | None, dfd: int, items: list[tuple[Any, ...]], umask: int
    ) -> None:
        """Copy the files the walk saw in one folder, each checked afterwards against what
        the walk saw (size, times, inode) and copied once more if it changed.

        The hot loop of a million-file copy, so the common case is written out here:
        seven system calls and little else per file (docs/performance.md).
        """
        reader = source_reader()
        shared = reader is not None and reader.public and not reader.vouched
        # Where a gateway opens sources (stager.rights), it opens the folder's files in
        # one exchange: a round trip per file would cost several times the copy.
        reach = access()
        opened = None
        if reach is not DIRECT and sfd is not None:
            opened = reach.open_many(sfd, [item[0] for item in items], _SOURCE_FLAGS)
        try:
            self._copy_opened(reach, sfd, dfd, items, opened, shared)
        finally:
            for fd in opened or ():
                if fd >= 0:
                    with contextlib.suppress(OSError):
                        os.close(fd)

    def _copy_opened(
        self,
        reach: Any,
        sfd: int | None,
        dfd: int,
        items: list[tuple[Any, ...]],
        opened: list[int] | None,
        shared: bool,
    ) -> None:
        check = self.verify != "none"
        done_bytes = made_bytes = 0
        for index, (name, dname, size, atime, mtime, ctime, ino, _mode) in enumerate(items):
            if opened is None:
                try:
                    fin = reach.open(name, _SOURCE_FLAGS, dir_fd=sfd)
                except OSError as exc:
                    exc.filename = _shown(sfd, name)  # its path in the sentence, not its name
                    raise
            else:
                fin, opened[index] = opened[index], -1  # this loop closes it now
                if fin < 0:
                    raise OSError(-fin, os.strerror(-fin), _shown(sfd, name))
            try:
                if shared:
                    check_public(fin, _shown(sfd, name))
                try:
                    fout = os.open(dname, _CREATE_FLAGS, FILE_MODE, dir_fd=dfd)
                except FileExistsError:
                    fout = _replace(dfd, dname, FILE_MODE, size, mtime)
                    if fout < 0:  # complete from an earlier run of this staging
                        done_bytes += size
                        made_bytes += size
                        continue
                try:
                    if size > CHUNK:
                        copied = self._move(fin, fout, size)  # counts its own progress
                    else:
                        copied = copy_chunk(fin, fout, 0, size) if size else 0
                        if 0 < copied < size:
                            copied += self._move(fin, fout, size, copied)
                        done_bytes += copied
                    if check:
                        after = os.fstat(fin)
                        # nlink 0: the name holds another file now (replaced by a rename).
                        if (
                            copied != size
                            or after.st_mtime_ns != mtime
                            or after.st_ctime_ns != ctime
                            or after.st_size != size
                            or after.st_ino != ino
                            or not after.st_nlink
                        ):
                            os.close(fout)
                            fout = -1
                            shown = _shown(sfd, name)
                            self.copy_checked(_opener(sfd, name), shown, dfd, dname)
                            continue
                        if self.verify == "sha256":
                            _compare_digests(fin, fout, _shown(sfd, name))
                    # The mtime goes last: it marks the file complete for a restart.
                    os.utime(fout, ns=(atime, mtime))
                    made_bytes += copied
                finally:
                    if fout >= 0:
                        os.close(fout)
            finally:
                os.close(fin)
        self.advance(done_bytes)
        self.made(made_bytes)

    def copy_checked(
        self, opener: Callable[[], int], shown: str, dfd: int, dname: str, again: bool = False
    ) -> None:
        """Copy with the "before" taken on the descriptor itself; a change fails, or
        (``again``) is copied once more."""
        fin = opener()
        try:
            before = os.fstat(fin)
            if not stat.S_ISREG(before.st_mode):
                raise refuse_special(shown, before.st_mode)
            fout = _create(dfd, dname, FILE_MODE)
            try:
                copied = self._move(fin, fout, before.st_size)
                if self.verify != "none":
                    after = os.fstat(fin)
                    if copied != before.st_size or _identity(after) != _identity(before):
                        if not again:
                            raise _changed(shown)
                        os.close(fout)
                        fout = -1
                        self.copy_checked(opener, shown, dfd, dname)
                        return
                    if self.verify == "sha256":
                        _compare_digests(fin, fout, shown)
                os.utime(fout, ns=(before.st_atime_ns, before.st_mtime_ns))
                self.made(copied)
            finally:
                if fout >= 0:
                    os.close(fout)
        finally:
            os.close(fin)

    def _move(self, fin: int, fout: int, size: int, done: int = 0) -> int:
        """Copy in CHUNK pieces, so progress and cancel are seen within a large file;
        returns the bytes moved from ``done`` on."""
        start = done
        while done < size:
            n = copy_chunk(fin, fout, done, min(CHUNK, size - done))
            if n == 0:
                break  # the source shrank under us; the check after says so
            done += n
            self.advance(n)
            if done < size:
                self.check_stop()
        return done - start


def _identity(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev, st.st_nlink > 0)


def _changed(shown: str) -> VerifyFailed:
    return VerifyFailed(
        f"source {shown} changed while it was copied, twice (its size, mtime or ctime "
        "moved); stage again once nothing writes to it, or copy a snapshot of it"
    )


def _shown(sfd: int | None, name: str) -> str:
    """The source's path for a sentence (workers know their folder only by descriptor)."""
    if sfd is None:
        return name
    return os.path.join(os.readlink(f"/proc/self/fd/{sfd}"), name)


def _opener(sfd: int | None, name: str) -> Callable[[], int]:
    return lambda: access().open(name, _SOURCE_FLAGS, dir_fd=sfd)


def _create(dfd: int, name: str, mode: int) -> int:
    """A new destination file with ``mode`` (every copy's is FILE_MODE: read-only, as
    the published tree keeps it), replacing whatever is there."""
    try:
        fd = os.open(name, _CREATE_FLAGS, mode, dir_fd=dfd)
    except FileExistsError:
        fd = _replace(dfd, name, mode, -1, 0)
    if mode & forked.umask():
        os.fchmod(fd, mode)
    return fd


def _replace(dfd: int, name: str, mode: int, size: int, mtime: int) -> int:
    """Something is where a file goes: -1 when it is that file already, complete (same
    ``size`` and ``mtime``, from an earlier run); else it is removed (a partial file, a
    link, a folder left by an interrupted run), never followed, and a new file made."""
    if size >= 0 and _is_complete(dfd, name, size, mtime):
        return -1
    remove(dfd, name)
    return os.open(name, _CREATE_FLAGS, mode, dir_fd=dfd)


def _is_complete(dfd: int, name: str, size: int, mtime: int) -> bool:
    """A file left by an earlier run with the source's size and mtime: complete."""
    try:
        have = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return stat.S_ISREG(have.st_mode) and have.st_size == size and have.st_mtime_ns == mtime


def remove(dfd: int, name: str) -> None:
    """Whatever is at ``name`` in ``dfd`` (a file, a link, a folder), never followed."""
    have = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    if stat.S_ISDIR(have.st_mode):
        shutil.rmtree(name, dir_fd=dfd)
    else:
        os.unlink(name, dir_fd=dfd)


def _compare_digests(fin: int, fout: int, shown: str) -> None:
    want, got = _sha256(fin), _sha256(fout)
    if want != got:
        raise VerifyFailed(
            f"copy of {shown} has sha256 {got} but the source has {want}; "
            "check the source and the local disk, then stage again"
        )


def _sha256(fd: int) -> str:
    digest = hashlib.sha256()
    offset = 0
    while chunk := os.pread(fd, READ_CHUNK, offset):
        digest.update(chunk)
        offset += len(chunk)
    return digest.hexdigest()
