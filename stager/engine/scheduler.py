"""The staging loop: when a queued entry runs (in admission's fair queue) and what
becomes of its staging (published, failed, cancelled, interrupted by a stop), each
change made by the registry. Entries, names and leases change on the event loop only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from stager.core.errors import Cancelled, InsufficientSpace, NotPublic, StagerError, from_os_error
from stager.core.metrics import Metrics
from stager.core.settings import Settings
from stager.engine.admission import PREFETCHING, Admission, Held, owner_of
from stager.engine.job import staging_job
from stager.engine.lifecycle import Registry, open_registry
from stager.fanout.room import FanoutRoom
from stager.ops import table
from stager.staging.blocking import INTERNAL, Processes, run_io, run_staging
from stager.state.dataset import CANCELLED_BY_REQUEST, Ask, Entry, ErrorInfo, Handle, State

log = logging.getLogger("stager.engine.scheduler")

STATE_STORE_FAILED = ErrorInfo(
    type="internal_error",
    message="the daemon could not record this staging in its state database; see the daemon "
    "log, check the cache disk, then stage again",
)


class Engine:
    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.ops = table.for_settings(settings)
        self.registry: Registry | None = None
        self.admission = Admission(settings)
        self._tasks: set[asyncio.Task[Any]] = set()  # kept so they are not garbage-collected
        self._running: set[asyncio.Future[Any]] = set()
        self.stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self.started = False
        # ``as_user`` is the one way the engine, the registry and the fan-out room act
        # for a user.
        self.processes = Processes(
            separate_users=settings.multi_user, users_timeout_s=settings.user_process_timeout_s
        )
        self.as_user = self.processes.as_user
        self.fanout = FanoutRoom(settings, self.ops, self.admission, self.as_user)
        # For each name a shared staging that met a private file leaves (requests sets it).
        self.restage: Callable[[Entry], Awaitable[None]] | None = None

    @property
    def reg(self) -> Registry:
        assert self.registry is not None, "the engine has not started"
        return self.registry

    # ---- start and stop -----------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self.processes.start()
        self.registry = await open_registry(
            self.settings, self.metrics, self.ops, self._spawn, self.as_user
        )
        self.admission.bind(self.registry, self._held, self._exporting)
        for entry in await self.reg.load():
            self.requeue(entry)
        # Deliveries and exports of an earlier run: nobody will adopt or send them now.
        await self.fanout.clear_deliveries()
        for leftover in await run_io(lambda: list(self.settings.outgoing_dir.iterdir())):
            await self.reg.trash.discard(leftover)  # exports: the service's own folders
        for i in range(self.settings.max_workers):
            self._spawn(self._worker(), f"worker-{i}")
        self._spawn(self._flush_progress(), "progress-flusher")
        self._spawn(self._sweep(), "cache-sweeper")
        # A loop of its own: an owner whose process does not answer delays only their
        # own deliveries' sweep.
        expire = partial(self.fanout.expire, self._spawn)
        self._spawn(self._every_sweep("transfer sweep", expire), "transfer-sweeper")
        self.started = True

    def request_stop(self) -> None:
        """From a signal handler: uvicorn drains open requests before the lifespan
        shutdown, so long-polls are answered and stagings told to stop here, or the
        drain runs into its timeout."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._begin_stop)

    def _begin_stop(self) -> None:
        self.stopping = True
        if self.registry is None:
            return
        self.reg.trash.halt.set()
        for entry in self.reg.entries.values():
            if entry.state == State.STAGING:
                entry.cancel.set()
        self._spawn(self.reg.notify(), "wake-waiters")

    async def stop(self) -> None:
        """Stop accepting work; running stagings stay resumable and are resumed at start."""
        self._begin_stop()
        if self._running:
            await asyncio.wait(self._running, timeout=self.settings.shutdown_timeout_s)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.processes.close()
        if self.registry is not None:
            staging = [e for e in self.reg.entries.values() if e.active]
            await self.reg.save_progress(staging)
            await self.reg.close()

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def entries(self) -> list[Entry]:
        return list(self.reg.entries.values()) if self.registry else []

    async def _held(self) -> Held:
        """The fan-out room is asked only while it holds any: a request with no fan-out
        never enters it."""
        return await self.fanout.held() if self.fanout.holding else Held(0, set(), {})

    def _exporting(self) -> set[str]:
        return self.fanout.exporting if self.fanout.holding else set()

    # ---- the queue --------------------------------------------------------------------

    async def enqueue(
        self,
        entry: Entry | None,
        key: str,
        spec: dict[str, Any],
        ask: Ask,
        room_of: int | None,
        low: bool | None = None,
    ) -> Entry:
        """Queue a staging of ``key`` (new, or an ended ``entry`` again) once admission
        made room on ``room_of``'s quota (None: shared). Hold the admission lock."""
        low = PREFETCHING.get() is not None if low is None else low
        await self.admission.make_room(ask.estimate_bytes, key, room_of, request=not low)
        entry = entry or Entry(key=key, spec=spec, steps=[], verify="")
        await self.reg.queue(entry, ask)
        self.admission.queue.put(key, owner_of(entry), low)
        return entry

    def wanting(self, entry: Entry) -> list[Handle]:
        """The names that want ``entry``: every name on it that its owner has not ended."""
        return [h for h in self.reg.handles.values() if h.key == entry.key and h.ended is None]

    def requeue(self, entry: Entry) -> None:
        """A queued entry waits in the turn of each user whose name wants it (never one
        who ended theirs); with none (or one user's daemon), of the user it is read as."""
        if entry.state != State.QUEUED:
            return
        wanting = {h.owner for h in self.wanting(entry)} if self.settings.multi_user else set()
        low = self.admission.prefetch_only(entry.key)  # a prefetch's stays low
        for owner in sorted(wanting) or [owner_of(entry)]:
            self.admission.queue.put(entry.key, owner, low)

    # ---- staging ---------------------------------------------------------------------

    async def _worker(self) -> None:
        while True:
            key, owner = await self.admission.queue.get()
            try:
                entry = self.reg.entries.get(key)
                if entry is None or entry.state != State.QUEUED or self.stopping:
                    continue
                self.reg.begin(entry)  # in this step, before anything may look at it
                # A task of its own, which a stop waits for whole: the outcome of a
                # staging the stop interrupts is recorded before the daemon exits.
                staging = asyncio.ensure_future(self._stage(entry))
                self._running.add(staging)
                try:
                    await staging
                except Exception:
                    # The state store failed under us (disk full, database locked): this
                    # entry is lost to this run, but the worker must live on for the queue.
                    log.exception("could not record the outcome of staging %s", entry.key)
                    await self.reg.fail_unrecorded(entry, STATE_STORE_FAILED)
                finally:
                    self._running.discard(staging)
            finally:
                self.admission.queue.finished(owner)

    async def _stage(self, entry: Entry) -> None:
        reg = self.reg
        attempt = await reg.start(entry)
        job, limits = await staging_job(
            entry, attempt, self.settings, self.ops, reg, self.admission, self.fanout,
            await self._held(),
        )  # fmt: skip
        future = asyncio.ensure_future(
            run_staging(job, self.processes, entry.progress, entry.cancel, limits)
        )
        try:
            try:
                seal = await future
            finally:
                # Its low slot is free before anything below may queue its key again.
                self.admission.queue.ended(entry.key)
                await self.drop_claimed(entry)  # read once: gone before ready is said
        except NotPublic as exc:
            # Names move to their owners' own stagings first, so that nobody waiting on
            # them is woken by this failure: it is not theirs.
            if self.restage is not None:
                await self.restage(entry)
            await reg.end(entry, State.FAILED, ErrorInfo(**exc.to_dict()))
        except Cancelled:
            if self.stopping:
                await reg.interrupt(entry)  # resumed when the daemon starts again
            elif self.wanting(entry):
                # Another name joined while the cancel was under way: it never asked for
                # the cancel, so the staging goes on for it (resumed, as after a stop).
                await reg.interrupt(entry)
                self.requeue(entry)
            else:
                await reg.end(entry, State.CANCELLED, CANCELLED_BY_REQUEST)
        except StagerError as exc:
            await reg.end(entry, State.FAILED, ErrorInfo(**exc.to_dict()))
        except OSError as exc:
            error = from_os_error(exc, "staging")
            await reg.end(entry, State.FAILED, ErrorInfo(**error.to_dict()))
        except Exception:
            # A bug must fail this dataset loudly, not wedge it in STAGING.
            log.exception("internal error while staging %s", entry.key)
            await reg.end(entry, State.FAILED, ErrorInfo(type="internal_error", message=INTERNAL))
        else:
            try:
                await reg.publish(entry, seal)
            except (StagerError, OSError) as exc:  # an image that could not be mounted
                error = exc if isinstance(exc, StagerError) else from_os_error(exc, "mounting")
                await reg.end(entry, State.FAILED, ErrorInfo(**error.to_dict()))
        finally:
            # For the next staging, now that this one's outcome is told.
            self.processes.prepare_spare()

    async def drop_claimed(self, entry: Entry) -> None:
        """A delivery is read once: it goes when its staging ends, whatever the outcome."""
        if entry.delivery is not None:
            await self.reg.drop_delivery(entry, self.fanout.staging_ends(entry))

    async def until(self, going: Callable[[], bool], timeout: float) -> None:
        """Wait while ``going()`` holds, ``timeout`` seconds at most (or until a stop)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        changed = self.reg.changed
        async with changed:
            while going() and not self.stopping:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    await asyncio.wait_for(changed.wait(), remaining)
                except TimeoutError:
                    break

    # ---- sweeping --------------------------------------------------------------------

    async def _flush_progress(self) -> None:
        while True:
            await asyncio.sleep(self.settings.progress_flush_s)
            staging = [e for e in self.reg.entries.values() if e.state == State.STAGING]
            if staging:
                await self.reg.save_progress(staging)

    async def _sweep(self) -> None:
        async def shrink() -> None:
            await self.reg.drop_dead_leases()
            await self.reg.sweep_held()
            try:
                async with self.admission.lock:
                    await self.admission.make_room(0, "")
            except InsufficientSpace:
                pass  # over the limit with everything leased: nothing more can go now

        await self._every_sweep("cache sweep", shrink)

    async def _every_sweep(self, what: str, sweep: Callable[[], Awaitable[None]]) -> None:
        """``sweep`` every ``sweep_interval_s``; a round that fails is logged."""
        while True:
            await asyncio.sleep(self.settings.sweep_interval_s)
            try:
                await sweep()
            except (OSError, StagerError) as exc:
                log.error("%s failed: %s", what, exc)
            except Exception:  # noqa: BLE001 - the sweep must outlive any one round's bug
                log.exception("%s failed; it runs again in the next round", what)
