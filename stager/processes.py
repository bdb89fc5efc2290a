"""Every process the daemon starts, owned by one object: :class:`Processes`.

The engine creates it at its start and closes it at its stop; nothing here lives in
a module global or starts at import. It holds:

- **the fork server** (multiprocessing's): a single-threaded process started with
  :mod:`stager.preload` imported, so that everything forked from it starts in
  milliseconds with every op loaded. The daemon itself runs threads (uvicorn, anyio),
  which a plain fork would clone mid-state, so it never forks: it asks the server.
- **the spare**: a staging process forked once a staging has ended, waiting for the
  next one's job (stager.worker.stage_when_sent): a staging that finds it starts in
  the time of a pipe write (the fork and the hand-over of its pipe and shared memory,
  ~5 ms, as much as the rest of a one-file staging, were paid between stagings).
- **the walker**: one long-lived process, forked at the start, for a walk that needs
  processes of its own (the seal's check of a large tree on a hit), so that a hit
  never waits for a process to start.
- **the user processes** (stager.rights.pool): the processes that became a user, for
  a request's work on that user's paths.

Which of these runs with which rights: stager.rights.
"""

from __future__ import annotations

import asyncio
import functools
import json
import multiprocessing
import multiprocessing.connection
import os
import threading
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple, ParamSpec, TypeVar

import anyio.to_thread

from stager.children import WALKER_NAME, die_with, name_process
from stager.prestart import start_fork_server
from stager.progress import SharedCounters
from stager.rights.become import Identity
from stager.rights.pool import UserProcesses
from stager.worker import stage_when_sent

P = ParamSpec("P")
T = TypeVar("T")


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
        self.context = multiprocessing.get_context("forkserver")
        self.users = UserProcesses(self.context, users_per_user, users_idle_s, users_timeout_s)
        self._walker: ProcessPoolExecutor | None = None
        self._spare: _Spare | None = None
        self._spare_lock = threading.Lock()
        self._stopped = False
        self._making: asyncio.Future[Any] | None = None  # the next spare's fork
        # Spares being made and reaps under way, kept so they are not garbage-collected.
        self._background: set[asyncio.Future[Any]] = set()

    # ---- start and stop ----------------------------------------------------------------

    async def start(self) -> None:
        """The fork server and the walker, ready before the first request (an
        interpreter's start, ~0.5 s, paid here and not by the first staging or hit), and
        a spare for the first staging."""
        await anyio.to_thread.run_sync(self._start)
        self.prepare_spare()

    def _start(self) -> None:
        start_fork_server()  # started already where ``stager serve`` began (stager.prestart)
        # The walker dies with the daemon, whatever ends the daemon (its parent is the
        # fork server, which outlives us by a moment).
        self._walker = ProcessPoolExecutor(
            1, mp_context=self.context, initializer=_walker_starts, initargs=(os.getpid(),)
        )
        self._walker.submit(os.getpid).result()  # started now, not at the first hit

    async def close(self) -> None:
        """At the daemon's stop: the spare, told there is no job, exits; the walker and
        the user processes end; nothing is forked after this."""
        with self._spare_lock:
            spare, self._spare, self._stopped = self._spare, None, True
        if spare is not None:
            await anyio.to_thread.run_sync(self._close_spare, spare)
        if self._walker is not None:
            walker, self._walker = self._walker, None
            await anyio.to_thread.run_sync(
                functools.partial(walker.shutdown, wait=True, cancel_futures=True)
            )
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
            result = await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))
            return json.loads(json.dumps(result))  # the same answers as a user process's
        return await self.users.call(who, fn, *args, **kwargs)

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
        daemon pid)``: a request to the fork server, which hands the child the pipe and
        the counters' shared memory (milliseconds; blocking)."""
        counters = SharedCounters(self.context)
        cancel = self.context.Event()
        receiver, sender = self.context.Pipe(duplex=False)
        process = self.context.Process(
            target=target, args=(first, counters, cancel, sender, os.getpid()), name=name
        )
        process.start()
        sender.close()
        return Child(process, counters, cancel, receiver)

    def take_spare(self, job: Any) -> Child | None:
        """The spare, given ``job``; None if there is none or it died (killed, out of
        memory): fork one then. One that dies in the instant between the look and the
        hand-over fails its staging, as any staging process dying at its start does."""
        with self._spare_lock:
            spare, self._spare = self._spare, None
        if spare is None:
            return None
        try:
            if not spare.child.process.is_alive():  # the fork server has reaped it
                raise BrokenPipeError
            spare.jobs.send(job)
        except OSError:
            self._close_spare_later(spare)
            return None
        spare.jobs.close()
        return spare.child

    def prepare_spare(self) -> None:
        """A spare for the next staging, forked in the background: call it once a staging
        has ended and its outcome is told (not as one starts: the fork would take the CPU
        from the starting staging, whose process yields it to everyone)."""
        if self._making is None or self._making.done():
            self._making = asyncio.ensure_future(anyio.to_thread.run_sync(self._make_spare))
            self._keep(self._making)

    def _make_spare(self) -> None:
        """Fork the next spare, unless there is one (blocking). The lock is held only to
        look and to store it: a staging that takes the spare meanwhile (on the loop) must
        not wait for a fork."""
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

    def _close_spare(self, spare: _Spare) -> None:
        """Tell the spare there is no job, and reap it (blocking)."""
        spare.jobs.close()
        spare.child.outcome.close()
        reap(spare.child.process, 1.0)

    def _close_spare_later(self, spare: _Spare) -> None:
        spare.jobs.close()
        spare.child.outcome.close()
        self.reap_later(spare.child.process, 1.0)

    def reap_later(self, process: Any, grace_s: float) -> None:
        """Reap a child off the loop (one that answered, or a dead spare)."""
        self._keep(asyncio.ensure_future(anyio.to_thread.run_sync(reap, process, grace_s)))

    def _keep(self, future: asyncio.Future[Any]) -> None:
        self._background.add(future)
        future.add_done_callback(self._background.discard)


def _walker_starts(daemon_pid: int) -> None:
    die_with(daemon_pid)
    name_process(WALKER_NAME)


def reap(process: Any, grace_s: float) -> None:
    """Join a finished child; kill one that is still running after ``grace_s``."""
    process.join(grace_s)
    if process.is_alive():
        process.kill()
        process.join()
