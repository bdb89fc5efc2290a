"""One extraction's job, and what the tar and zip readers share.

An archive is a byte range of an open file (:class:`Archive`). The job
(:class:`ExtractJob`) carries the context, the pools, and the inner archives still
being extracted. Links are judged by :func:`judge_link`; library errors become the
daemon's in :func:`translate`, the one place that maps them.
"""

from __future__ import annotations

import errno
import io
import lzma
import os
import tarfile
import zipfile
import zlib
from collections.abc import Iterator
from concurrent.futures import Executor, Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import zstandard
from isal import isal_zlib

from stager.archive.formats import archive_suffix
from stager.archive.writer import NUL_IN_NAME, WriterContext, unsafe
from stager.core.errors import CorruptArchive, StagerError, StagingIOError, UnknownFormat
from stager.fs.sources import within
from stager.wire.progress import ProgressSink

_CORRUPT = (
    tarfile.TarError,
    zipfile.BadZipFile,
    EOFError,
    zlib.error,
    isal_zlib.error,
    lzma.LZMAError,
    zstandard.ZstdError,
)


class ExtractContext(WriterContext, Protocol):
    """What an extraction needs of the op's context (an ``OpContext`` is one)."""

    def check_cancelled(self) -> None: ...


@dataclass
class InnerContext:
    """The context of an archive inside the outer one, extracted whole by one worker:
    its own tally (returned to the outer job when done) and the request's verify level.
    The outer job checks for cancel between its tasks; an inner archive runs to its end."""

    progress: ProgressSink
    verify: str
    workers: int = 4  # sizes the writer's queue only: an inner archive has no pool

    def check_cancelled(self) -> None:
        pass


@dataclass
class Archive:
    """An archive as a byte range of an open file: a whole file or a nested member;
    or a download still arriving (``growing``), read once as a stream, ``length`` 0."""

    fd: int
    base: int
    length: int
    fmt: str
    label: str  # how messages name it
    growing: io.RawIOBase | None = None

    def reader(self) -> io.RawIOBase:
        """The archive's bytes from its first: the growing file, or a view of the range."""
        return self.growing or RangeFile(self.fd, self.base, self.length)


@dataclass
class ExtractJob:
    ctx: ExtractContext
    strip: int
    nested: bool
    files_pool: Executor | None = None  # writes the outer archive's files
    inner_pool: Executor | None = None  # extracts inner archives, one task each
    inner: list[Future[tuple[int, int]]] = field(default_factory=list)
    inner_roots: dict[str, Future[tuple[int, int]]] = field(default_factory=dict)
    written_inner: dict[str, str] = field(default_factory=dict)  # path -> label

    def start_inner(self, task: Any, *args: Any) -> Future[tuple[int, int]]:
        """Run ``task(*args) -> (bytes, files)`` on the inner pool; count it when done."""
        assert self.inner_pool is not None
        future = self.inner_pool.submit(task, *args)
        future.add_done_callback(self._count_inner)
        self.inner.append(future)
        return future

    def _count_inner(self, future: Future[tuple[int, int]]) -> None:
        if not future.cancelled() and future.exception() is None:
            self.ctx.progress.advance(*future.result())

    def note_written_inner(self, root: str, rel: str, archive: Archive) -> None:
        """An archive member written as a file (compressed or zip outers): extracted,
        then removed, once the outer archive is done."""
        self.written_inner[os.path.join(root, rel)] = f"{archive.label}:{rel}"

    def wait_inner(self) -> None:
        for future in self.inner:
            self.ctx.check_cancelled()
            future.result()

    def cancel_inner(self) -> None:
        for future in self.inner:
            future.cancel()
        for future in self.inner:
            if not future.cancelled():
                future.exception()  # wait, so nothing writes after the extraction returns


def nested_suffix(rel: str) -> str | None:
    """The archive extension of a member's file name, if it names an archive."""
    return archive_suffix(rel.rpartition("/")[2])


class RangeFile(io.RawIOBase):
    """A read-only, seekable view of ``length`` bytes at ``base`` of a descriptor
    (``pread``: one descriptor shared by many threads)."""

    def __init__(self, fd: int, base: int, length: int) -> None:
        super().__init__()
        self._fd, self._base, self._length, self._pos = fd, base, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        count = min(len(buffer), self._length - self._pos)
        if count <= 0:
            return 0
        done = os.preadv(self._fd, [memoryview(buffer)[:count]], self._base + self._pos)
        self._pos += done
        return done

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        anchor = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._length}[whence]
        self._pos = max(0, anchor + pos)
        return self._pos

    def tell(self) -> int:
        return self._pos


def judge_link(rel: str, target: str, hard: bool, root: str, archive: str, label: str) -> None:
    """Refuse a link (of a tar or a zip) at ``rel`` whose ``target`` is absolute, cannot
    be a path, or resolves outside ``root``; ``label`` names the member in the error.

    tarfile's data filter's rule, written here since Debian 12's Python 3.11.2 lacks
    it. A hard link's target is relative to ``root``, a symlink's to its folder; both
    resolved as they stand on disk now (``realpath``).
    """
    if "\0" in target:
        raise unsafe(archive, label, NUL_IN_NAME)
    top = os.path.realpath(root)
    # The link's own place: its folder as it resolves, and its name, which it replaces.
    head, name = os.path.split(rel)
    place = os.path.join(os.path.realpath(os.path.join(top, head)), name)
    if not within(place, top):
        raise unsafe(archive, label, f"{rel!r} would be made at {place!r}, {OUTSIDE}")
    if os.path.isabs(target):
        raise unsafe(archive, label, f"{rel!r} is a link to an absolute path")
    base = top if hard else os.path.join(top, head)
    resolved = os.path.realpath(os.path.join(base, target))
    if not within(resolved, top):
        raise unsafe(archive, label, f"{rel!r} would link to {resolved!r}, {OUTSIDE}")


OUTSIDE = "which is outside the destination"


@contextmanager
def translate(archive: str) -> Iterator[None]:
    """The one place where library and OS errors become the daemon's errors."""
    try:
        yield
    except StagerError:
        raise
    except _CORRUPT as exc:
        raise _corrupt(archive, exc) from exc
    except NotImplementedError as exc:  # zipfile: a compression method it lacks
        raise UnknownFormat(
            f"archive {archive} uses a zip compression method that is not supported ({exc}); "
            "re-create it with deflate or store"
        ) from exc
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise StagingIOError(
                f"the local disk is full while extracting {archive}; free space in the cache "
                "directory or stage fewer datasets"
            ) from exc
        if exc.errno is None:  # gzip/bz2 report bad data as an OSError without errno
            raise _corrupt(archive, exc) from exc
        raise StagingIOError(
            f"extracting {archive} failed: {exc.strerror} ({exc.filename or 'archive'}); "
            "check the disk and permissions"
        ) from exc


def _corrupt(archive: str, exc: BaseException) -> CorruptArchive:
    return CorruptArchive(
        f"archive {archive} is truncated or corrupt ({exc}); re-download or re-create it"
    )
