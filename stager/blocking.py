"""The one doorway from the event loop to blocking work.

``run_io`` runs short blocking calls (a SQLite write, a stat of a source) on
anyio's thread pool. ``run_staging`` runs a whole staging in a child process
(see ``stager.worker`` for why) and awaits it without blocking the loop.
``run_in_process`` runs a long walk that needs processes of its own (the seal's
check of a large tree on a hit) in one long-lived process forked by the fork
server: the daemon runs threads, so it must never fork per-file workers itself.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import multiprocessing.connection
import os
import threading
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple, ParamSpec, TypeVar

import anyio.to_thread

from stager import errors
from stager.children import die_with
from stager.fs.seal import Seal
from stager.progress import Progress, SharedCounters
from stager.worker import CONTEXT, StageJob, stage_in_child, stage_when_sent, start_fork_server

log = logging.getLogger("stager.staging")

P = ParamSpec("P")
T = TypeVar("T")


async def run_io(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """Run a short blocking call off the event loop."""
    return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))


_walker: ProcessPoolExecutor | None = None


async def run_in_process(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """Run ``fn`` (importable, its arguments picklable) in the walking process."""
    global _walker
    if _walker is None:
        await run_io(start_fork_server)
        # It dies with the daemon, whatever ends the daemon (the fork server is its parent).
        _walker = ProcessPoolExecutor(
            1, mp_context=CONTEXT, initializer=die_with, initargs=(os.getpid(),)
        )
    call = functools.partial(fn, *args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(_walker, call)


def stop_walker() -> None:
    """At the daemon's stop (blocking: call it off the loop)."""
    global _walker
    if _walker is not None:
        _walker.shutdown(wait=True, cancel_futures=True)
        _walker = None


@dataclass(frozen=True)
class Limits:
    """How long a staging process may take to act on a cancel, and to show no progress."""

    cancel_grace_s: float = 3.0
    stall_timeout_s: float = 0.0  # 0: no limit


async def run_staging(
    job: StageJob,
    progress: Progress,
    cancel: threading.Event,
    limits: Limits = Limits(),  # noqa: B008 - frozen
    poll_s: float = 0.1,
) -> Seal:
    """Stage ``job`` in a child process; return its tree's seal or raise its error.

    ``cancel`` is forwarded to the child, which stops at its next unit of work. A
    child that has not stopped ``cancel_grace_s`` later, or whose counters have not
    moved for ``stall_timeout_s``, is stuck in a system call (a hung network
    filesystem, a source that never answers) and is ended: no staging holds a
    worker slot forever, and a cancel takes seconds.
    """
    child = _take_spare(job)
    if child is None:
        await run_io(start_fork_server)  # the first time: an interpreter start, off the loop
        child = _fork(stage_in_child, job, name=f"stager-stage-{job.final.name}")
    process, counters, child_cancel, receiver = child
    loop = asyncio.get_running_loop()
    cancelled_at: float | None = None
    last, moved_at = counters.read(), loop.time()
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
            await run_io(_reap, process, 0.0)
        else:
            # It has answered and is exiting; waiting for that would hold up the publish.
            _reap_later(process, limits.cancel_grace_s)
    progress.mirror(counters)
    return _outcome(message)


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


# Reaps of children that answered, kept so they are not garbage-collected.
_reaping: set[asyncio.Future[None]] = set()


def _reap_later(process: Any, grace_s: float) -> None:
    reap = asyncio.ensure_future(run_io(_reap, process, grace_s))
    _reaping.add(reap)
    reap.add_done_callback(_reaping.discard)


def _reap(process: Any, grace_s: float) -> None:
    """Join a finished child; kill one that is still running after ``grace_s``."""
    process.join(grace_s)
    if process.is_alive():
        process.kill()
        process.join()


class _Child(NamedTuple):
    """A staging process and what the daemon holds of it: its shared counters, its
    cancel event, the pipe its outcome comes back on."""

    process: Any
    counters: SharedCounters
    cancel: Any
    outcome: multiprocessing.connection.Connection


def _fork(target: Callable[..., None], first: Any, name: str) -> _Child:
    """A child of the fork server running ``target(first, counters, cancel, pipe,
    daemon pid)``: a request to the fork server, which hands the child the pipe and
    the counters' shared memory (milliseconds)."""
    counters = SharedCounters(CONTEXT)
    cancel = CONTEXT.Event()
    receiver, sender = CONTEXT.Pipe(duplex=False)
    process = CONTEXT.Process(
        target=target, args=(first, counters, cancel, sender, os.getpid()), name=name
    )
    process.start()
    sender.close()
    return _Child(process, counters, cancel, receiver)


@dataclass
class _Spare:
    """A staging process forked before its job, waiting for it on ``jobs``
    (stager.worker.stage_when_sent). A staging that finds one starts in the time of a
    pipe write: the fork and the hand-over of the child's pipe and shared memory (~5 ms,
    as much as the rest of a one-file staging) were paid between stagings, off anyone's
    clock."""

    child: _Child
    jobs: multiprocessing.connection.Connection


_spare: _Spare | None = None
_spare_lock = threading.Lock()
_spares_stopped = False
# Spares being made in the background, kept so they are not garbage-collected.
_making: set[asyncio.Future[None]] = set()


def _take_spare(job: StageJob) -> _Child | None:
    """The spare, given ``job``; None if there is none or it died (killed, out of
    memory): fork one then. One that dies in the instant between the look and the
    hand-over fails its staging, as any staging process dying at its start does."""
    global _spare
    with _spare_lock:
        spare, _spare = _spare, None
    if spare is None:
        return None
    try:
        if not spare.child.process.is_alive():  # the fork server has reaped it
            raise BrokenPipeError
        spare.jobs.send(job)
    except OSError:
        _close(spare, later=True)
        return None
    spare.jobs.close()
    return spare.child


def prepare_spare() -> None:
    """A spare for the next staging, forked in the background: call it once a staging
    has ended and its outcome is told (not as one starts: the fork would take the CPU
    from the starting staging, whose process yields it to everyone)."""
    if not _making:
        making = asyncio.ensure_future(run_io(_make_spare))
        _making.add(making)
        making.add_done_callback(_making.discard)


def _make_spare() -> None:
    """Fork the next spare, unless there is one (blocking: run it off the loop). The
    lock is held only to look and to store it: a staging that takes the spare meanwhile
    (on the loop) must not wait for a fork."""
    global _spare
    with _spare_lock:
        if _spare is not None or _spares_stopped:
            return
    start_fork_server()
    jobs, sender = CONTEXT.Pipe(duplex=False)
    child = _fork(stage_when_sent, jobs, name="stager-spare")
    jobs.close()
    spare = _Spare(child, sender)
    with _spare_lock:
        if not _spares_stopped:
            _spare, spare = spare, None
    if spare is not None:  # the daemon stopped meanwhile
        _close(spare)


def stop_spare() -> None:
    """At the daemon's stop (blocking: call it off the loop): the spare, told there is
    no job, exits; none is made after this."""
    global _spare, _spares_stopped
    with _spare_lock:
        spare, _spare, _spares_stopped = _spare, None, True
    if spare is not None:
        _close(spare)


def _close(spare: _Spare, later: bool = False) -> None:
    """Tell the spare there is no job, and reap it: at once (blocking), or ``later``
    (on the loop)."""
    spare.jobs.close()
    spare.child.outcome.close()
    (_reap_later if later else _reap)(spare.child.process, 1.0)


def _outcome(message: tuple[str, Any]) -> Seal:
    """The seal of the child's tree, or its error re-raised in the daemon."""
    kind, payload = message
    if kind == "ok":
        return Seal.from_dict(payload)
    if kind == "cancelled":
        raise errors.Cancelled("staging was cancelled")
    if kind == "error":
        class_name, _type, text = payload
        raise getattr(errors, class_name, errors.StagingError)(text)
    if kind == "oserror":
        number, strerror, filename = payload
        raise OSError(number, strerror, filename)
    raise errors.StagingProcessDied(
        f"internal error in the staging process; see the daemon log:\n{payload}"
    )
