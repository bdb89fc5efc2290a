"""A file that a download is still writing, read as it grows.

An archive is extracted while it downloads (:mod:`stager.staging.overlap`) through a
:class:`GrowingFile`: a read at the end of the bytes so far waits until more arrive,
the download ends (the end of the file is then the archive's) or fails (it raises).

What is read must be the finished file's bytes: the download only appends; starting
over from byte 0 begins a new *generation*, and a reader of an older one raises
:class:`StartOver`. At its end a reader holds the inode the download renamed into
place, in the generation the download ended with.

The download's side is :class:`Growth` (``writing``, ``wrote``, ``end``); the
reader's side is ``Growth.open()``.
"""

from __future__ import annotations

import io
import os
import threading
from pathlib import Path
from typing import Protocol

from stager.core.errors import Cancelled

# A read returns once this much (or what it asked for, if less) is there: decompressors
# handed a few KiB per call would spend their time in call overhead.
READ_MIN = 256 << 10
# How often a waiting reader looks again without being told (cancel, close, a missed
# wake-up); a write wakes it at once.
POLL_S = 0.1


class CancelFlag(Protocol):
    """The staging's cancel signal (an op context's ``cancel``)."""

    def is_set(self) -> bool: ...


class StartOver(Exception):
    """The download started its file over: read it again from the first byte."""


class DownloadFailed(Exception):
    """The download this reader follows failed; its own error says why."""


class Growth:
    """One download's file as it grows: told by the download, read by the extraction.
    ``part`` is the file appended to, ``final`` its name once complete and verified."""

    def __init__(self, part: Path, final: Path, cancel: CancelFlag) -> None:
        self.part, self.final = part, final
        self._cancel = cancel
        self._changed = threading.Condition()
        self.generation = 0
        self.started = False  # the download has opened its file (or found it complete)
        self.ended = False
        self.failed = False

    # -- the download's side --------------------------------------------------------

    def writing(self, offset: int) -> None:
        """The download's file is open to append at ``offset``; bytes before it are kept.
        Offset 0: a new file (or one cut back to empty), so a new generation."""
        with self._changed:
            if offset == 0:
                self.generation += 1
            self.started = True
            self._changed.notify_all()

    def wrote(self) -> None:
        """More bytes are in the file (written through, visible to ``pread``)."""
        with self._changed:
            self._changed.notify_all()

    def end(self, ok: bool) -> None:
        """The download ended: complete and renamed to ``final`` when ``ok``."""
        with self._changed:
            self.ended, self.failed = True, not ok
            self._changed.notify_all()

    # -- the reader's side ----------------------------------------------------------

    def open(self) -> GrowingFile:
        """A reader of the current generation's file, from its first byte."""
        while True:
            with self._changed:
                self._check(None)
                if not (self.started or self.ended):
                    self._changed.wait(POLL_S)
                    continue
                generation = self.generation
            for path in (self.part, self.final):  # renamed when complete: same inode
                try:
                    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                except FileNotFoundError:
                    continue
                return GrowingFile(self, fd, generation)
            with self._changed:  # between an unlink and the new file: wait for it
                self._changed.wait(POLL_S)

    def _check(self, generation: int | None) -> None:
        """Raise what stops a reader of ``generation`` now; call holding ``_changed``."""
        if self._cancel.is_set():
            raise Cancelled("staging was cancelled")
        if self.failed:
            raise DownloadFailed(f"the download of {self.final.name} failed")
        if generation is not None and generation != self.generation:
            raise StartOver(f"the download of {self.final.name} started over")

    def wait_for(self, reader: GrowingFile, size: int, wanted: int) -> bool:
        """Wait until the file holds ``wanted`` bytes beyond ``size``... or a while; True
        when the download has ended, so what the file holds now is all there is."""
        with self._changed:
            self._check(reader.generation)
            if self.ended:
                return True
            if os.fstat(reader.fd).st_size - size < wanted:
                self._changed.wait(POLL_S)
            return False

    def require_final(self, reader: GrowingFile) -> None:
        """At the end of the file: it must be the finished download, this generation."""
        with self._changed:
            self._check(reader.generation)
        held, final = os.fstat(reader.fd), os.stat(self.final)
        if (held.st_dev, held.st_ino) != (final.st_dev, final.st_ino):
            raise StartOver(f"{self.final.name} is not the file this reader followed")


class GrowingFile(io.RawIOBase):
    """A sequential reader of a download's file that waits at the end of what is there.

    ``close`` stops reads (a waiting one within ``POLL_S``: a decompressor's read-ahead
    thread may be waiting). The descriptor stays open until ``release``, once no thread
    can read it (closed under a read, it could hand that read another file)."""

    def __init__(self, growth: Growth, fd: int, generation: int) -> None:
        super().__init__()
        self.growth, self.fd, self.generation = growth, fd, generation
        self._pos = 0
        self.reached_end = False

    def readable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.fd

    def tell(self) -> int:
        return self._pos

    def head(self, size: int) -> bytes:
        """The file's first ``size`` bytes (fewer if it ends sooner), waiting for them."""
        while True:
            ended = self.growth.wait_for(self, 0, size)
            data = os.pread(self.fd, size, 0)
            if len(data) == size or ended:
                return data

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        view = memoryview(buffer)
        wanted = min(len(view), READ_MIN)
        while True:
            if self.closed:
                raise ValueError("read of a closed file (the extraction stopped)")
            # Before reading, so bytes of a newer generation are never handed out.
            ended = self.growth.wait_for(self, self._pos, wanted)
            available = os.fstat(self.fd).st_size - self._pos
            if available >= wanted or (ended and available > 0):
                done = os.preadv(self.fd, [view], self._pos)
                self._pos += done
                return done
            if ended:
                self.growth.require_final(self)
                self.reached_end = True
                return 0

    def confirm(self) -> None:
        """After a reader stopped short of the end: raise ``StartOver`` unless what it
        read is the start of the finished file (the download must have ended)."""
        self.growth.require_final(self)

    def release(self) -> None:
        self.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
