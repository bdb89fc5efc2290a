"""Worker processes for an op that walks a tree: the walk stays on the staging process,
the per-file work goes to forked workers, one per core.

Processes, because per-file work is system calls wrapped in Python that holds the GIL
(docs/performance.md); forked, because the staging process has imported everything,
so a worker costs milliseconds and inherits the shared counters. Each worker adds its
progress into its own slots of one shared array, which the walking process sums while
it waits for room in the queue; chunks are a folder's files, a few queued per worker,
so memory does not grow with the tree.

Until ``parallel_after`` files (or ``PARALLEL_AFTER_BYTES``) :class:`Workers` runs each
chunk on the calling thread. The only other thread then waits in ``select()`` for the
daemon's exit (:func:`stager.core.processes.die_with`) and holds no lock, which keeps
the later fork safe.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Executor, Future, wait
from contextlib import contextmanager
from typing import Any

from stager.core.errors import Cancelled
from stager.core.processes import FORK, die_with_parent, fork_pool
from stager.fs.sources import Folder, Visitor, walk
from stager.wire.progress import ProgressSink, report_written

_CONTEXT = FORK
# A few large files are worth the workers too: copying them is memory bandwidth,
# which two cores have more of than one.
PARALLEL_AFTER_BYTES = 128 << 20
# Slot 0: stop (set on error or cancel); then per worker (bytes done, files done, bytes
# made): progress, and what the op left in the tree (lstat sizes), so the staging need
# not measure it. The walking process, running chunks inline, is worker 0.
_tally: Any = None
_slot = 1
# On the walking process: the op's cancel flag, and its umask (workers have none).
_cancel: Any = None
_umask = 0


def report(nbytes: int = 0, files: int = 0) -> None:
    """Count work done by this process (a worker, or the walker running a chunk)."""
    _tally[_slot] += nbytes
    _tally[_slot + 1] += files


def report_bytes(nbytes: int) -> None:
    _tally[_slot] += nbytes


def report_made(nbytes: int) -> None:
    """Count bytes this process left in the tree (a file's size, a link's length)."""
    _tally[_slot + 2] += nbytes


def stopping() -> bool:
    """The op failed elsewhere or was cancelled: drop the rest of the chunk."""
    return bool(_tally[0]) or (_cancel is not None and _cancel.is_set())


def umask() -> int:
    """What the kernel will take from a new file's mode in this process."""
    return _umask


def _init_worker(tally: Any, slots: Any) -> None:
    global _tally, _slot, _cancel, _umask
    die_with_parent()
    gc.disable()  # see paused_gc
    os.umask(0)  # files are created with the source's mode exactly: no chmod per file
    with slots.get_lock():
        slots.value += 1
        index = slots.value
    _tally, _slot, _cancel, _umask = tally, 1 + 3 * index, None, 0


@contextmanager
def paused_gc() -> Iterator[None]:
    """No garbage collection while a tree is walked or an archive read: the per-file
    work makes no cycles, and each collection re-scans the whole heap (a quarter of a
    million-file copy's time). Processes forked meanwhile inherit the pause."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def cores(workers: int) -> int:
    """Processes (or threads) for per-file work: ``workers`` capped at the cores this
    process may run on, since that work is CPU-bound (only a copy from a network
    filesystem runs more: ``stager.ops.copy.NETWORK_IN_FLIGHT``)."""
    return max(1, min(workers, len(os.sched_getaffinity(0))))


class Workers:
    """Runs chunks of per-file work inline, then on forked processes once a tree is
    large enough to repay them; forwards their progress; re-raises their errors here.

    ``then`` callbacks run on the walking thread once their chunk is done (a folder's
    mtime can be set once its last chunk has been written).
    """

    def __init__(
        self, processes: int, progress: ProgressSink, parallel_after: int, cancel: Any = None
    ) -> None:
        global _tally, _slot, _cancel, _umask
        self._processes = processes
        self._progress = progress
        self._parallel_after = parallel_after
        self._seen = self._seen_bytes = 0
        self._pool: Executor | None = None
        self._pending: dict[Future[Any], Callable[[], None] | None] = {}
        self._tally = _CONTEXT.RawArray("q", 1 + 3 * (processes + 1))
        self._forwarded = [0, 0, 0]
        self._cancel = cancel
        self._paused_gc: Any = None
        _umask = os.umask(0o22)
        os.umask(_umask)
        _tally, _slot, _cancel = self._tally, 1, cancel

    @property
    def made(self) -> int:
        """The bytes every process reported leaving in the tree (:func:`report_made`)."""
        return sum(self._tally[3::3])

    def submit(
        self,
        fn: Callable[..., None],
        *args: Any,
        files: int,
        nbytes: int = 0,
        then: Callable[[], None] | None = None,
    ) -> None:
        """Run ``fn(*args)`` (``files`` files', ``nbytes`` bytes' work) here or on a worker."""
        self._check_cancel()
        self._seen += files
        self._seen_bytes += nbytes
        if (
            self._pool is None
            and self._processes > 1
            and (self._seen >= self._parallel_after or self._seen_bytes >= PARALLEL_AFTER_BYTES)
        ):
            self._start()
        if self._pool is None:
            fn(*args)
            self.pump()
            if then is not None:
                then()
            return
        while len(self._pending) >= 4 * self._processes:
            self._reap(timeout=0.1)
        self._pending[self._pool.submit(fn, *args)] = then

    def walk(self, top: Folder, visitor: Visitor, special: str, flush: Callable[[], None]) -> None:
        """Walk ``top`` with ``visitor`` (which hands its chunks to :meth:`submit`),
        then ``flush`` the last chunk and wait for every chunk; cancel is looked at
        between folders and at the end."""
        with self:
            walk(top, visitor, special, check=self._between_folders)
            flush()
        self._check_cancel()

    def _between_folders(self) -> None:
        self._check_cancel()
        self.pump()

    def __enter__(self) -> Workers:
        self._paused_gc = paused_gc()
        self._paused_gc.__enter__()
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        """Drain on success; on an error or cancel, stop the workers at once."""
        failed = exc_type is not None
        try:
            if not failed:
                failed = True  # until the drain has re-raised nothing
                self.drain()
                failed = False
        finally:
            self.close(failed)
            self._paused_gc.__exit__(None, None, None)

    def drain(self) -> None:
        while self._pending:
            self._reap(timeout=0.1)
        self.pump()

    def pump(self) -> None:
        """Forward what the workers counted since last time to the op's progress."""
        tally = self._tally
        nbytes = sum(tally[1::3])
        files = sum(tally[2::3])
        made = sum(tally[3::3])
        before_bytes, before_files, before_made = self._forwarded
        if nbytes != before_bytes or files != before_files or made != before_made:
            self._forwarded = [nbytes, files, made]
            self._progress.advance(nbytes - before_bytes, files - before_files)
            report_written(self._progress, made - before_made)

    def close(self, failed: bool) -> None:
        """Stop the workers: at once (queued chunks dropped) when the op failed."""
        if failed:
            self._tally[0] = 1
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def _check_cancel(self) -> None:
        if self._cancel is not None and self._cancel.is_set():
            raise Cancelled("staging was cancelled")

    def _start(self) -> None:
        slots = _CONTEXT.Value("i", 0)
        # (The one other thread here only ever waits in select() for the daemon's exit,
        # holding no lock a fork could copy: children.die_with.)
        self._pool = fork_pool(self._processes, _init_worker, (self._tally, slots))

    def _reap(self, timeout: float) -> None:
        done, _ = wait(self._pending, timeout=timeout, return_when=FIRST_COMPLETED)
        self.pump()
        self._check_cancel()
        for future in done:
            then = self._pending.pop(future)
            future.result()  # a worker's error is raised here, on the walking thread
            if then is not None:
                then()
