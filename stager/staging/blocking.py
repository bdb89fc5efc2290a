"""The one doorway from the event loop to blocking work, and the daemon's processes.

``run_io`` runs short blocking calls (a SQLite write, a folder made in the cache) on
anyio's thread pool: the loop hands a blocking call to a thread here and nowhere else.
``run_staging`` runs a whole staging in a child process (see ``stager.staging.worker`` for why)
and awaits it without blocking the loop. :class:`Processes` holds the daemon's
long-lived children (the fork server's spare and walker, the user processes), created
at the engine's start and closed at its stop; stager.core.processes starts every one.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import multiprocessing.connection
import os
import threading
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, NamedTuple, ParamSpec, TypeVar

import anyio.to_thread

from stager.core import errors
from stager.core.identity import Caller
from stager.core.processes import (
    FORKSERVER,
    WALKER_NAME,
    die_with,
    fork_pool,
    name_process,
    reap,
    start_child,
    start_fork_server,
)
from stager.core.settings import Settings
from stager.rights import channel
from stager.rights.become import Identity
from stager.rights.pool import UserProcesses
from stager.staging.download_rate import DownloadRateFloor
from stager.staging.worker import (
    StageJob,
    WriteBound,
    past_bound,
    past_inode_bound,
    stage_in_child,
    stage_when_sent,
)
from stager.wire.progress import Progress, SharedCounters

log = logging.getLogger("stager.staging")

P = ParamSpec("P")
T = TypeVar("T")


async def run_io(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """Run a short blocking call off the event loop."""
    return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))


class Child(NamedTuple):
    """A staging process and what the daemon holds of it: its shared counters, its
    cancel event, the pipe its outcome comes back on."""

    process: Any
    counters: SharedCounters
    cancel: Any
    outcome: multiprocessing.connection.Connection


@dataclass
class _Spare:
    """A staging process forked before its job, waiting for it on ``jobs``."""

    child: Child
    jobs: multiprocessing.connection.Connection


class Processes:
    def __init__(
        self,
        separate_users: bool,
        users_per_user: int = 2,
        users_idle_s: float = 30.0,
        users_timeout_s: float = 60.0,
    ) -> None:
        self.separate_users = separate_users  # the node service: act for users as them
        self.context = FORKSERVER
        self.users = UserProcesses(users_per_user, users_idle_s, users_timeout_s, run_io)
        self._walker: Executor | None = None
        self._spare: _Spare | None = None
        self._spare_lock = threading.Lock()
        self._stopped = False
        self._making: asyncio.Future[Any] | None = None  # the next spare's fork
        # Spares being made and reaps under way, kept so they are not garbage-collected.
        self._background: set[asyncio.Future[Any]] = set()

    # ---- start and stop ----------------------------------------------------------------

    async def start(self) -> None:
        """The fork server and the walker, ready before the first request (the server's
        preload and the walker's fork, paid here and not by the first staging or hit),
        and a spare for the first staging."""
        await run_io(self._start)
        self.prepare_spare()

    def _start(self) -> None:
        # `stager serve` forked it already (stager.cli); an engine made in a process with
        # threads (the tests) starts it here, as a new interpreter.
        start_fork_server()
        # The walker dies with the daemon, whatever ends the daemon (its parent is the
        # fork server, which outlives us by a moment); started now, not at the first hit.
        self._walker = fork_pool(1, _walker_starts, (os.getpid(),), context=self.context)

    async def close(self) -> None:
        """At the daemon's stop: the spare, told there is no job, exits; the walker and
        the user processes end; nothing is forked after this."""
        with self._spare_lock:
            spare, self._spare, self._stopped = self._spare, None, True
        if spare is not None:
            await run_io(self._close_spare, spare)
        if self._walker is not None:
            walker, self._walker = self._walker, None
            await run_io(walker.shutdown, wait=True, cancel_futures=True)
        await self.users.close()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    # ---- acting for a user -------------------------------------------------------------

    async def run_as(
        self, who: Identity | None, fn: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> Any:
        """``fn(*args, **kwargs)`` with ``who``'s rights, its result as JSON data: in the
        node service in a process that became them (stager.rights.pool); in a per-user
        daemon, or for root, on a thread here (the daemon is that user already)."""
        if who is None or who.is_root or not self.separate_users:
            result = await run_io(fn, *args, **kwargs)
            return json.loads(json.dumps(result))  # the same answers as a user process's
        return await self.users.call(who, fn, *args, **kwargs)

    async def as_user(self, who: Caller | int | None, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` with a user's rights (a caller, or a uid), as :meth:`run_as`: the
        one way the engine, the registry and the fan-out act for a user. Never awaited
        under the admission lock: a user's process may take its time."""
        if who is None or not self.separate_users:
            return await self.run_as(None, fn, *args)
        caller = who if isinstance(who, Caller) else Caller.of_uid(who)
        return await self.run_as(caller.identity, fn, *args)

    # ---- the walker ----------------------------------------------------------------------

    async def run_in_walker(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run ``fn`` (importable, its arguments picklable) in the walking process."""
        if self._walker is None:
            raise RuntimeError("the daemon's processes are not started (or stopped)")
        call = functools.partial(fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._walker, call)

    # ---- staging processes -------------------------------------------------------------

    def fork(self, target: Callable[..., None], first: Any, name: str) -> Child:
        """A child of the fork server running ``target(first, counters, cancel, pipe,
        daemon pid)`` (milliseconds; blocking)."""
        counters = SharedCounters(self.context)
        cancel = self.context.Event()
        receiver, sender = self.context.Pipe(duplex=False)
        process = start_child(target, (first, counters, cancel, sender, os.getpid()), name)
        sender.close()
        return Child(process, counters, cancel, receiver)

    def take_spare(self, job: Any) -> Child | None:
        """The spare, given ``job``; None if there is none or it died: fork one then. One
        dying between the look and the hand-over fails its staging, as any would."""
        with self._spare_lock:
            spare, self._spare = self._spare, None
        if spare is None:
            return None
        try:
            if not spare.child.process.is_alive():  # the fork server has reaped it
                raise BrokenPipeError
            spare.jobs.send(job)
        except OSError:
            self._close_spare(spare, later=True)
            return None
        spare.jobs.close()
        return spare.child

    def prepare_spare(self) -> None:
        """A spare for the next staging, forked in the background once a staging has ended
        (as one starts, the fork would take the CPU from it)."""
        if self._making is None or self._making.done():
            self._making = asyncio.ensure_future(run_io(self._make_spare))
            self._keep(self._making)

    def _make_spare(self) -> None:
        """Fork the next spare, unless there is one (blocking). The lock is held only to
        look and to store it: a staging taking the spare must not wait for a fork."""
        with self._spare_lock:
            if self._spare is not None or self._stopped:
                return
        jobs, sender = self.context.Pipe(duplex=False)
        child = self.fork(stage_when_sent, jobs, name="stager-spare")
        jobs.close()
        spare: _Spare | None = _Spare(child, sender)
        with self._spare_lock:
            if not self._stopped:
                self._spare, spare = spare, None
        if spare is not None:  # the daemon stopped meanwhile
            self._close_spare(spare)

    def _close_spare(self, spare: _Spare, later: bool = False) -> None:
        """Tell the spare there is no job, and reap it: now (blocking), or ``later``
        (off the loop, called on it)."""
        spare.jobs.close()
        spare.child.outcome.close()
        if later:
            self.reap_later(spare.child.process, 1.0)
        else:
            reap(spare.child.process, 1.0)

    def reap_later(self, process: Any, grace_s: float) -> None:
        """Reap a child off the loop (one that answered, or a dead spare)."""
        self._keep(asyncio.ensure_future(run_io(reap, process, grace_s)))

    def _keep(self, future: asyncio.Future[Any]) -> None:
        self._background.add(future)
        future.add_done_callback(self._background.discard)


def _walker_starts(daemon_pid: int) -> None:
    die_with(daemon_pid)
    name_process(WALKER_NAME)


@dataclass(frozen=True)
class Limits:
    """How long a staging process may take to act on a cancel, and to show no progress;
    the most bytes and inodes it may make (None: no limit); how slowly its downloads may
    bring bytes; and ``shared``, raising once every staging under way together passes a
    bound they share (stager.engine.job)."""

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
    mode) or raise its error. A child not stopped ``cancel_grace_s`` after a cancel, or
    whose counters stood still for ``stall_timeout_s`` (stuck in a system call), or
    whose download is below the rate floor, is ended: none holds a slot forever."""
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


def _outcome(message: dict[str, Any], name: str) -> Any:
    """The seal of the child's tree (or, in image mode, its image), or its error
    re-raised in the daemon. A bug's traceback goes to the daemon log only: what the
    client is told is one sentence (it may hold paths and code no user should see)."""
    if "internal" in message:
        log.error("internal error in the staging process of %s:\n%s", name, message["internal"])
        raise errors.StagingProcessDied(INTERNAL)
    return channel.result(message, errors.StagingError)


# What a client is told of a bug in a staging, wherever it struck (stager.engine.scheduler too).
INTERNAL = (
    "internal error while staging (a bug in stager); the daemon log has the details; "
    "stage again, and report it with the log if it happens again"
)
