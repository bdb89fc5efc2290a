"""The one doorway from the event loop to blocking work.

``run_io`` runs short blocking calls (a SQLite write, a folder made in the cache) on
anyio's thread pool. ``run_staging`` runs a whole staging in a child process (see
``stager.worker`` for why; forked by :class:`stager.processes.Processes`, which owns
every process the daemon starts) and awaits it without blocking the loop.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

import anyio.to_thread

from stager import errors
from stager.download_rate import DownloadRateFloor
from stager.processes import Processes, reap
from stager.progress import Progress
from stager.settings import Settings
from stager.worker import StageJob, WriteBound, past_bound, past_inode_bound, stage_in_child

log = logging.getLogger("stager.staging")

P = ParamSpec("P")
T = TypeVar("T")


async def run_io(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """Run a short blocking call off the event loop."""
    return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))


@dataclass(frozen=True)
class Limits:
    """How long a staging process may take to act on a cancel, and to show no progress;
    and the most bytes it may leave in its tree and inodes it may make (its user's quota
    less what they hold already, or the disk's room above its floor; None: no limit);
    how slowly its downloads may bring bytes (stager.download_rate); and ``shared``, a
    check of what every staging under way has made together, raising once they pass a
    bound they share (stager.engine: a user's inode quota, the disk's inode floor)."""

    cancel_grace_s: float = 3.0
    stall_timeout_s: float = 0.0  # 0: no limit
    write_bytes: int | None = None
    write_bound: WriteBound = "quota"  # what sets write_bytes
    min_download_bytes_per_s: int = 0  # 0: no limit
    download_rate_window_s: float = 60.0
    write_inodes: int | None = None
    inode_bound: WriteBound = "quota"  # what sets write_inodes
    shared: Callable[[], None] | None = None

    @classmethod
    def of(
        cls,
        settings: Settings,
        write_bytes: int | None = None,
        write_bound: WriteBound = "quota",
        write_inodes: int | None = None,
        inode_bound: WriteBound = "quota",
        shared: Callable[[], None] | None = None,
    ) -> Limits:
        return cls(
            settings.cancel_grace_s,
            settings.stall_timeout_s,
            write_bytes,
            write_bound,
            settings.min_download_rate,
            settings.download_rate_window_s,
            write_inodes,
            inode_bound,
            shared,
        )


async def run_staging(
    job: StageJob,
    processes: Processes,
    progress: Progress,
    cancel: threading.Event,
    limits: Limits = Limits(),  # noqa: B008 - frozen
    poll_s: float = 0.1,
) -> Any:
    """Stage ``job`` in a child process; return its tree's seal (its image, in image
    mode) or raise its error.

    ``cancel`` is forwarded to the child, which stops at its next unit of work. A
    child that has not stopped ``cancel_grace_s`` later, or whose counters have not
    moved for ``stall_timeout_s``, is stuck in a system call (a hung network
    filesystem, a source that never answers) and is ended, as is one whose download
    brings bytes below the rate floor: no staging holds a worker slot forever, and a
    cancel takes seconds.
    """
    child = processes.take_spare(job)
    if child is None:
        child = await run_io(processes.fork, stage_in_child, job, f"stager-stage-{job.final.name}")
    process, counters, child_cancel, receiver = child
    loop = asyncio.get_running_loop()
    cancelled_at: float | None = None
    last, moved_at = counters.read(), loop.time()
    floor = DownloadRateFloor(
        job.steps, limits.min_download_bytes_per_s, limits.download_rate_window_s
    )
    message = None
    # The outcome is awaited on the pipe itself, not polled for: a small staging ends
    # a few milliseconds after it starts, and a poll interval would be its whole cost.
    answered = asyncio.Event()
    loop.add_reader(receiver.fileno(), answered.set)
    try:
        while message is None:
            now = loop.time()
            if cancel.is_set() and cancelled_at is None:
                child_cancel.set()
                cancelled_at = now
            progress.mirror(counters)
            _check_bounds(progress, limits)
            if (seen := counters.read()) != last:
                last, moved_at = seen, now
            if receiver.poll():
                try:
                    message = receiver.recv()
                except EOFError:  # it closed the pipe without a word: it died
                    await run_io(process.join, limits.cancel_grace_s)
                    raise _died(process) from None
            elif not process.is_alive():
                if receiver.poll():
                    continue
                raise _died(process)
            elif cancelled_at is not None and now - cancelled_at > limits.cancel_grace_s:
                log.warning("staging of %s ignored its cancel; ending it", job.final.name)
                raise errors.Cancelled("staging was cancelled (its process was ended)")
            elif limits.stall_timeout_s and now - moved_at > limits.stall_timeout_s:
                raise errors.StagingStalled(_stalled(job, progress, limits.stall_timeout_s))
            elif slow := floor.check(now, progress.step_index, progress.bytes_done):
                raise errors.StagingStalled(slow)
            else:
                try:
                    await asyncio.wait_for(answered.wait(), poll_s)
                except TimeoutError:
                    pass
    finally:
        loop.remove_reader(receiver.fileno())
        child_cancel.set()  # no-op when it finished; stops it when we are being cancelled
        receiver.close()
        if message is None:
            await run_io(reap, process, 0.0)
        else:
            # It has answered and is exiting; waiting for that would hold up the publish.
            processes.reap_later(process, limits.cancel_grace_s)
    progress.mirror(counters)
    outcome = _outcome(message, job.final.name)
    _check_bounds(progress, limits)  # what the last look did not see (its final counts)
    return outcome


def _check_bounds(progress: Progress, limits: Limits) -> None:
    """Raise once what the staging has written or made is past its bounds, or with the
    other stagings under way past those they share (:attr:`Limits.shared`)."""
    if limits.write_bytes is not None and progress.bytes_written > limits.write_bytes:
        raise past_bound(limits.write_bound, progress.bytes_written)
    if limits.write_inodes is not None and progress.inodes_made > limits.write_inodes:
        raise past_inode_bound(limits.inode_bound, progress.inodes_made)
    if limits.shared is not None:
        limits.shared()


def _died(process: Any) -> errors.StagingProcessDied:
    return errors.StagingProcessDied(
        f"the staging process died with exit code {process.exitcode}; "
        "see the daemon log, then stage again"
    )


def _stalled(job: StageJob, progress: Progress, limit: float) -> str:
    where = f"step {progress.step_index} ({progress.step})" if progress.step else "its start"
    return (
        f"staging made no progress for {limit:g} s in {where} and was ended; a source may "
        "be hung (a stalled network filesystem or server): check it and stage again, or "
        "raise --stall-timeout"
    )


def _outcome(message: tuple[str, Any], name: str) -> Any:
    """The seal of the child's tree (or, in image mode, its image), or its error
    re-raised in the daemon. A bug's traceback goes to the daemon log only: what the
    client is told is one sentence (it may hold paths and code no user should see)."""
    kind, payload = message
    if kind == "ok":
        return payload
    if kind == "cancelled":
        raise errors.Cancelled("staging was cancelled")
    if kind == "error":
        class_name, _type, text = payload
        raise getattr(errors, class_name, errors.StagingError)(text)
    if kind == "oserror":
        number, strerror, filename = payload
        raise OSError(number, strerror, filename)
    log.error("internal error in the staging process of %s:\n%s", name, payload)
    raise errors.StagingProcessDied(INTERNAL)


# What a client is told of a bug in a staging, wherever it struck (stager.engine too).
INTERNAL = (
    "internal error while staging (a bug in stager); the daemon log has the details; "
    "stage again, and report it with the log if it happens again"
)
