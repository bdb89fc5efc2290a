"""An index image: a plain tar copied once, whole, and an image of its metadata only.

Building an ordinary image of a plain tar copies every member's content into it, a
system call or two per member (20,000 files of 4-100 KB: 2.2x a ``cp`` of the tar).
An index image leaves the content where it is. The tar is copied to the cache as
one file, the *blob*, in the kernel (``copy_file_range``: ``cp``'s speed), and the
image holds the folders, names and inodes only, each file's inode pointing at its
content's blocks in the blob. EROFS allows this since Linux 6.4 (512-byte blocks,
a tar's own; erofs-utils 1.7 makes the same with ``mkfs.erofs --tar=i``): the blob
is mounted as the image's extra device, and the device table maps its blocks into
the image's block space (:class:`stager.image.erofs.Blob`).

The image is built while the copy runs, from the source's headers (two cores: the
copy is the kernel's, the headers Python's). The source must not change meanwhile:
its identity (device, inode, size, times) is taken before and checked after both,
and a change fails the build, as a copy's would.

Mounting needs a file-backed EROFS mount (Linux 6.12): the kernel opens the extra
device as a file only when the image itself is a file; behind a loop device it
wants a block device (a second loop device) for the blob too
(:func:`stager.image.mount.mount_kernel`).

What the image holds is what :mod:`stager.image.build` makes of the same tar (the
same member rules and names); what differs: members whose content does not start on
a 512-byte block of the blob (none in a tar; the sparse members' data, which has
holes) are copied into the image, which is then larger, nothing more.

An *embedded* index image (``blob=None``) is one file: the tar is copied into the
image itself, at 4 KiB (:data:`stager.image.erofs.EMBEDDED_AT`), on the copy's
thread and into its own descriptor of the image file, while the metadata is written
after it. It mounts as any image (the kernel's 512-byte blocks, Linux 6.4+; not
through Debian 12's ``erofsfuse``), is sent and checked as one file, and holds the
tar's headers besides the content (512 bytes a member).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from stager.archive.formats import resolve_format
from stager.core.errors import UnknownFormat, VerifyFailed
from stager.core.processes import Threaded
from stager.fs.durable_names import sync_folder
from stager.fs.fastcopy import copy_chunk
from stager.fs.writeback import start_writeback
from stager.image.build import RUN_BYTES, BuildOptions, Built, TarInput, build_from
from stager.image.erofs import EMBEDDED_AT, Blob


@dataclass
class Indexed:
    """What an indexed build made: the image (``image.path``) and its blob (None:
    embedded in the image)."""

    image: Built
    blob: str | None
    blob_bytes: int
    copy_seconds: float  # the blob's copy, synced, from the start


class SourceChanged(VerifyFailed):
    """The source tar changed while it was copied and indexed (as an extraction's
    source that moves: stager.ops.extract)."""


def _identity(fd: int) -> tuple[int, ...]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def build_indexed(
    source: str,
    blob: str | None,
    output: str,
    options: BuildOptions | None = None,
    fd: int | None = None,
) -> Indexed:
    """Copy the plain tar ``source`` to ``blob`` (None: into the image, embedded) and
    build the index image ``output`` of it, at once; both synced (unless
    ``options.sync`` is off), the blob renamed into place before the image, the image
    last: its name says both are whole. ``fd``: the source opened already (a
    staging's, through its gateway; the caller closes it)."""
    options = options or BuildOptions()
    src = os.open(source, os.O_RDONLY | os.O_CLOEXEC) if fd is None else fd
    try:
        before = _identity(src)
        size = before[2]
        if resolve_format(source, "auto", os.pread(src, 512, 0)) != "tar":
            raise UnknownFormat(
                f"archive {source} is not a plain tar; an index image keeps a plain tar's "
                "content in place: build an ordinary image of a compressed one"
            )
        if blob is None:  # into the image's partial file, once the build has opened it
            copy = _Copy(src, "", size, options.sync, options.mode, at=EMBEDDED_AT)
        else:
            copy = _Copy(src, blob + ".partial", size, options.sync, options.mode)
            copy.start()
        follow = _Following(copy, options, size)

        def opened(partial: str) -> None:
            if blob is None:
                copy.path = partial
                copy.start()

        def before_publish() -> None:
            _copied_whole(copy, src, before, source)
            if blob is not None:
                os.rename(blob + ".partial", blob)

        try:
            tag = os.path.basename(blob or output).encode()
            built = build_from(
                [TarInput(source, options.names, fd=src)],
                output,
                dataclasses.replace(options, progress=follow, check=follow.check),
                blob=Blob(src, size, tag, embedded=blob is None),
                before_publish=before_publish,
                opened=opened,
            )
        finally:
            copy.stop.set()  # a failed build stops the copy at its next chunk
            copy.join()  # nothing if not started (an embedded one starts once opened)
            if blob is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(blob + ".partial")
        if options.sync and blob is not None:
            sync_folder(os.path.dirname(os.path.abspath(blob)))
    finally:
        if fd is None:
            os.close(src)
    return Indexed(built, blob, size, copy.seconds)


def _copied_whole(copy: _Copy, src: int, before: tuple[int, ...], source: str) -> None:
    """The copy ended whole, from a source that did not change meanwhile."""
    copy.join()
    if copy.error is not None:
        raise copy.error
    if _identity(src) != before:
        raise SourceChanged(
            f"archive {source} changed while it was copied into the cache; stage it again "
            "once nothing writes to it"
        )


# The copy's step: small enough that the headers are never far behind it (and that a
# failed build stops it soon), large enough that the system calls cost nothing (1 GB:
# 128 of them).
_CHUNK = 8 << 20
# How far past the last position told the copy must be before headers are read: a run
# of files not yet told, the header reader's window (stager.archive.tar_members.Blocks)
# and a block more.
_AHEAD = RUN_BYTES + (64 << 10) + 512


class _Following:
    """The header reader kept behind the copy. Before each window of headers is read
    (the build's ``check``) it waits until the copy is past it (from the position that
    ``advance`` has counted, a run of files behind at most: _AHEAD), so headers are read from
    the page cache the copy has just filled: a source not in the page cache is read
    from the disk once, in one stream, not twice at two places. Everything else goes
    to the build's own progress sink."""

    def __init__(self, copy: _Copy, options: BuildOptions, size: int) -> None:
        self._copy, self._progress, self._check = copy, options.progress, options.check
        self._size = size
        self._at = 0  # the next header's offset

    def __getattr__(self, name: str) -> Any:
        return getattr(self._progress, name)

    def add_total(self, nbytes: int = 0, files: int = 0) -> None:
        self._progress.add_total(nbytes, files)

    def advance(self, nbytes: int = 0, files: int = 0) -> None:
        self._at += nbytes
        self._progress.advance(nbytes, files)

    def check(self) -> None:
        copy = self._copy
        if not copy.done and copy.copied < self._at + _AHEAD:
            copy.wait_past(min(self._size, self._at + _AHEAD))
        self._check()


class _Copy(Threaded):
    """The blob's copy, in the kernel (``copy_file_range`` releases the GIL while it
    runs), synced: the other core's work while this one reads headers."""

    thread_name = "blob-copy"

    def __init__(
        self, src: int, path: str, size: int, sync: bool, mode: int, at: int | None = None
    ) -> None:
        """``at``: copied into the existing file ``path`` from that offset on (an
        embedded blob: the image's own file, whose fsync is the build's), else a new
        file of its own, synced here."""
        self.path, self._src, self._size, self._sync = path, src, size, sync
        self._at = at
        self._mode = mode  # the image's: 0444, or 0400 for a private copy
        self.stop = threading.Event()
        self.seconds = 0.0
        self.copied = 0  # bytes of the source copied so far: only grows
        self.done = False  # the copy has ended, whole or not
        self._moved = threading.Condition()

    def wait_past(self, offset: int) -> None:
        """Until the copy has passed ``offset`` of the source, or ended (either way)."""
        with self._moved:
            while self.copied < offset and not self.done:
                self._moved.wait()

    def _advanced(self, copied: int, done: bool = False) -> None:
        with self._moved:
            self.copied, self.done = copied, done
            self._moved.notify_all()

    def run(self) -> None:
        started = time.monotonic()
        try:
            if self._at is None:
                flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
                fd = os.open(self.path, flags, self._mode)
            else:  # a descriptor of its own: the image's writer moves its own position
                fd = os.open(self.path, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            base = self._at or 0
            try:
                os.lseek(fd, base, os.SEEK_SET)
                offset = 0
                while offset < self._size and not self.stop.is_set():
                    done = copy_chunk(self._src, fd, offset, min(_CHUNK, self._size - offset))
                    if done == 0:
                        raise EOFError(f"the source ended at byte {offset} of {self._size}")
                    if self._sync:
                        start_writeback(fd, base + offset, done)
                    offset += done
                    self._advanced(offset)
                if self._sync and self._at is None:
                    os.fsync(fd)
            finally:
                os.close(fd)
        except BaseException as exc:  # kept before a waiting reader is woken, to see it
            self.error = exc
        finally:
            self._advanced(self.copied, done=True)  # a waiting reader goes on, and sees why
        self.seconds = time.monotonic() - started
