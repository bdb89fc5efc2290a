"""A download and the extraction of what it downloads, run at once.

``fetch`` then ``extract`` of the fetched file would download the whole archive, then
read it again. Run as a pair, the download runs in a thread exactly as the op does
alone (``.part`` file, resume by Range, sha256, rename when complete) while the
extraction reads the file as it grows (:mod:`stager.archive.growing`). The op table's
``grows`` and ``follows`` columns say which steps pair up. ``follow_download`` gives
the growing file to another reader (an image's build, :mod:`stager.kinds.imaging`).

- Resume: a restarted staging runs the pair again; the download resumes from its
  ``.part``, the extraction starts again from the first byte on disk.
- A download that starts its file over starts the extraction over too.
- Errors: a failed download fails the pair with its error, even when the extraction
  got to its end (bytes that fail their sha256 never count); a failed extraction
  stops the download.
- A zip keeps its directory at its end: it is extracted once it is whole.
- Progress: the download's bytes and, again, the extraction's; the step shown is the
  download's until it ends.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar

from stager.archive.growing import DownloadFailed, GrowingFile, Growth, StartOver
from stager.core.errors import Cancelled, StagerError
from stager.core.processes import Threaded
from stager.ops.base import CancelSignal, OpContext
from stager.ops.table import OpTable
from stager.wire.progress import ProgressSink, report_written

T = TypeVar("T")


def run_pair(
    ops: OpTable, step: Any, following: Any, ctx: OpContext, downloaded: Callable[[], None]
) -> int | None:
    """Run ``step`` (its op ``grows`` a file) and ``following`` (its op ``follows`` it)
    at once; ``downloaded`` is called when the download is complete. Returns what the
    following op's ``run`` returns (the bytes an extraction left, when it counted them)."""
    second = ops.op_of(following)
    assert second.follows is not None
    follows = second.follows.run
    read, made = follow_download(
        ops, step, ctx, downloaded, lambda c, reader: follows(following, c, reader)
    )
    if read:
        return made
    # A zip: read now that the download is complete.
    return second.run(following, replace(ctx, progress=_NoTotals(ctx.progress)))


def follow_download(
    ops: OpTable,
    step: Any,
    ctx: OpContext,
    downloaded: Callable[[], None],
    read: Callable[[OpContext, GrowingFile], tuple[bool, T]],
) -> tuple[bool, T | None]:
    """Run the download ``step`` in a thread while ``read`` reads its file as it grows
    (again from the first byte if the download starts over). Returns what ``read``
    returned once the download is complete; (False, None) when ``read`` needs the whole
    file (complete on return)."""
    grows = ops.op_of(step).grows
    assert grows is not None
    part, final = grows.files(step, ctx)
    growth = Growth(part, final, ctx.cancel)
    stop = threading.Event()
    download = _Download(
        lambda: grows.run(
            step,
            replace(ctx, progress=_CountedTwice(ctx.progress), cancel=_Either(ctx.cancel, stop)),
            growth,
        ),
        growth,
        downloaded,
    )
    download.start()
    try:
        done, made = _follow(read, ctx, growth, download)
    except BaseException:
        stop.set()
        download.join()
        download.raise_failure(stopped=True)  # the cause, when the download failed first
        raise
    if not done:
        download.join()
        download.raise_failure()
    return done, made


def _follow(
    read_file: Callable[[OpContext, GrowingFile], tuple[bool, T]],
    ctx: OpContext,
    growth: Growth,
    download: _Download,
) -> tuple[bool, T | None]:
    """Run the reader on the growing file until it reads the finished one; returns
    what it returns (read False: it needs the whole file)."""
    tally = _Tally(ctx.progress)
    follow_ctx = replace(ctx, progress=tally)
    while True:
        reader = growth.open()
        try:
            read, made = read_file(follow_ctx, reader)
            if not read:
                return False, None
            download.join()
            download.raise_failure()
            reader.confirm()  # what it read is the finished file (it may stop short of its end)
            return True, made
        except StartOver:
            pass
        except DownloadFailed:
            download.join()
            download.raise_failure()
            raise
        except (StagerError, OSError):
            # Bytes of an older generation may read as a corrupt archive.
            if reader.generation == growth.generation:
                raise
        finally:
            reader.release()
        ctx.progress.add_total(tally.take(), 0)  # what it reads again


class _Download(Threaded):
    """The download's thread: its failure is kept, and told to the readers."""

    thread_name = "stager-download"

    def __init__(self, run: Callable[[], None], growth: Growth, downloaded: Callable[[], None]):
        self._run, self._growth, self._downloaded = run, growth, downloaded

    def run(self) -> None:
        try:
            self._run()
            self._downloaded()
        except BaseException:  # kept in ``error`` for the staging's thread to raise
            self._growth.end(ok=False)
            raise
        self._growth.end(ok=True)

    def raise_failure(self, stopped: bool = False) -> None:
        """Raise the download's error; when ``stopped`` (by the pair), not the Cancelled
        that stopping it caused."""
        if self.error is None or (stopped and isinstance(self.error, Cancelled)):
            return
        raise self.error


class _Either:
    """The staging's cancel, or the pair stopping its download."""

    def __init__(self, cancel: CancelSignal, stop: threading.Event) -> None:
        self._cancel, self._stop = cancel, stop

    def is_set(self) -> bool:
        return self._stop.is_set() or self._cancel.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.is_set():
            left = 0.1 if deadline is None else min(0.1, deadline - time.monotonic())
            if left <= 0:
                break
            self._stop.wait(left)
        return self.is_set()


class _CountedTwice:
    """The download's sink: its bytes are read again by the extraction, so the total
    counts them twice, as when the steps run one after the other."""

    def __init__(self, sink: ProgressSink) -> None:
        self._sink = sink

    def add_total(self, nbytes: int = 0, files: int = 0) -> None:
        self._sink.add_total(2 * nbytes, files)

    def advance(self, nbytes: int = 0, files: int = 0) -> None:
        self._sink.advance(nbytes, files)

    def wrote(self, nbytes: int, inodes: int = 0) -> None:
        report_written(self._sink, nbytes, inodes)


class _NoTotals(_CountedTwice):
    """The extraction of a whole download: its bytes are in the total already."""

    def add_total(self, nbytes: int = 0, files: int = 0) -> None:
        self._sink.add_total(0, files)


class _Tally(_CountedTwice):
    """The extraction's sink: counts the bytes it reports, to add them to the total when
    it starts over."""

    def __init__(self, sink: ProgressSink) -> None:
        super().__init__(sink)
        self._bytes, self._lock = 0, threading.Lock()

    def add_total(self, nbytes: int = 0, files: int = 0) -> None:
        self._sink.add_total(nbytes, files)

    def advance(self, nbytes: int = 0, files: int = 0) -> None:
        with self._lock:
            self._bytes += nbytes
        self._sink.advance(nbytes, files)

    def take(self) -> int:
        with self._lock:
            counted, self._bytes = self._bytes, 0
        return counted
