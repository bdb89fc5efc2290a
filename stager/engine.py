"""The staging engine: accepts requests, runs their steps off the event loop,
publishes atomically and keeps the state store in step.

All entry and handle state is mutated on the event loop only; worker threads
touch the filesystem and the thread-safe ``Progress`` counters, nothing else.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from stager import cache, preflight, recipes, slurm
from stager.blocking import run_io, run_staging
from stager.dataset import Entry, Handle, now, public_view, spec_key
from stager.errors import (
    BadRequest,
    Cancelled,
    Conflict,
    InsufficientSpace,
    NotFound,
    StagerError,
    from_os_error,
)
from stager.fingerprint import sources_fingerprint
from stager.leases import Lease
from stager.metrics import Metrics
from stager.ops import table
from stager.progress import Progress
from stager.publish import (
    DISCARDED_PREFIX,
    delete_tree,
    discard,
    make_link,
    remove_link,
    steps_marker,
)
from stager.schemas import (
    DatasetCreate,
    DatasetPublic,
    ErrorInfo,
    GcRequest,
    GcResult,
    LeaseCreate,
    LeasePublic,
    State,
)
from stager.settings import Settings
from stager.store import Store
from stager.worker import StageJob

log = logging.getLogger("stager.engine")

CANCELLED_BY_REQUEST = ErrorInfo(type="cancelled", message="staging was cancelled by a request")
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
        self._store: Store | None = None
        self._entries: dict[str, Entry] = {}
        self._handles: dict[str, Handle] = {}
        self._leases: dict[str, Lease] = {}
        # Held by whatever decides an entry's fate: admission, joins and hits, leases,
        # eviction. So an entry is never evicted between being chosen and being answered.
        self._admission = asyncio.Lock()
        self._freeing_bytes = 0  # evicted trees still being deleted in the background
        self._queue: asyncio.Queue[str] = asyncio.Queue()
        self._changed = asyncio.Condition()
        self._tasks: set[asyncio.Task[Any]] = set()  # kept so they are not garbage-collected
        self._running: set[asyncio.Future[Any]] = set()
        self._stopping = False
        self._halt = threading.Event()  # the same, for work on threads (background deletes)
        self._loop: asyncio.AbstractEventLoop | None = None
        self.started = False

    # ---- lifecycle -------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await run_io(preflight.ensure_dirs, self.settings)
        self._store = await run_io(Store, self.settings.db_path, self.ops)
        entries, handles, leases = await run_io(self._store.load)
        self._entries = {e.key: e for e in entries}
        self._handles = {h.name: h for h in handles if h.key in self._entries}
        self._leases = {lease.id: lease for lease in leases if lease.name in self._handles}
        await self._recover()
        try:
            # Recipe files are re-read per request; checking them now tells the admin early.
            await run_io(recipes.recipe_files, self.settings)
        except StagerError as exc:
            log.error("%s; requests naming a recipe will fail until it is fixed", exc.message)
        for i in range(self.settings.max_workers):
            self._spawn(self._worker(), f"worker-{i}")
        self._spawn(self._flush_progress(), "progress-flusher")
        self._spawn(self._sweep(), "cache-sweeper")
        self.started = True

    async def _recover(self) -> None:
        """After a restart: ready stays ready, interrupted stagings are queued again."""
        for entry in self._entries.values():
            if entry.state == State.STAGING:
                entry.move(State.QUEUED)
            if entry.state == State.QUEUED:
                log.info("resuming interrupted staging of %s", entry.key)
                # Ops re-count the work they find already done, so start the counters afresh.
                entry.progress = Progress(step_names=[s.op for s in entry.steps])
                await run_io(self._store_entry_sync, entry)
                self._queue.put_nowait(entry.key)
            elif entry.state == State.READY and not await run_io(self._final(entry).is_dir):
                entry.move(State.EVICTED)
                await run_io(self._store_entry_sync, entry)
        # Deleted in the background: a million-file leftover must not delay readiness.
        for orphan in await run_io(self._orphans):
            self._delete_in_background(orphan, 0)

    def _orphans(self) -> list[Path]:
        """What no entry owns: partial data of a failed cleanup, evicted trees whose
        deletion a stop interrupted, a tree whose eviction was recorded just before a
        crash (moved out of ``data/`` here). A tree under ``data/`` of a still-active
        entry was published just before a crash and is kept: its staging finds it."""
        live = {k for k, e in self._entries.items() if e.active}
        kept = live | {k for k, e in self._entries.items() if e.state == State.READY}
        found = []
        for folder, owned in ((self.settings.partial_dir, live), (self.settings.data_dir, kept)):
            for child in folder.iterdir():
                if child.name.split(".", 1)[0] in owned:
                    continue
                if child.name.startswith(DISCARDED_PREFIX):
                    found.append(child)
                # Renamed first: a request for the same key, staging into partial/<key>
                # while this is deleted, must find a fresh folder.
                elif trash := discard(child, self.settings.partial_dir):
                    found.append(trash)
        return found

    def request_stop(self) -> None:
        """From a signal handler: begin stopping before uvicorn drains connections.

        uvicorn waits for open requests before it runs the lifespan shutdown, so open
        long-polls must be answered (with their current, non-terminal status; clients
        poll again) and stagings told to stop here, or the drain runs into its timeout.
        """
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._begin_stop)

    def _begin_stop(self) -> None:
        self._stopping = True
        self._halt.set()
        for entry in self._entries.values():
            if entry.state == State.STAGING:
                entry.cancel.set()
        self._spawn(self._wake_waiters(), "wake-waiters")

    async def _wake_waiters(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def stop(self) -> None:
        """Stop accepting work; running stagings stay resumable and are re-queued at start."""
        self._begin_stop()
        if self._running:
            await asyncio.wait(self._running, timeout=self.settings.shutdown_timeout_s)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._store is not None:
            await run_io(self._store.save_progress, list(self._entries.values()))
            await run_io(self._store.close)

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- requests ----------------------------------------------------------

    async def submit(self, request: DatasetCreate) -> tuple[DatasetPublic, bool]:
        """Create or join a staging. Returns the status and whether it is already ready."""
        if request.recipe:
            expansion = await run_io(recipes.expand, request, self.settings)
        else:
            expansion = recipes.Expansion(steps=request.steps)
        spec = request.spec()
        request_key = spec_key(spec)
        self._check_name(request.name, request_key)  # early, before paying for a fingerprint
        await run_io(preflight.check_link, request.link, self.settings)
        fingerprint = await run_io(
            sources_fingerprint, expansion.steps, request.fingerprint == "deep"
        )
        key = spec_key({"spec": spec, "sources": fingerprint})
        existing = self._entries.get(key)
        if existing is None or not (existing.active or existing.state == State.READY):
            # Only a miss pays for validating sources and estimating the size (a walk).
            estimate = await run_io(
                preflight.check_steps, expansion.steps, request.verify, self.settings
            )
        else:
            estimate = existing.estimate_bytes

        # Decide under one lock: concurrent identical requests must see each other's entry.
        async with self._admission:
            self._check_name(request.name, request_key)  # again: another request may have won
            entry = self._entries.get(key)
            if entry is None or entry.state in (State.FAILED, State.CANCELLED, State.EVICTED):
                await self._admit(estimate, key)
                entry = await self._enqueue(entry, key, request, expansion, estimate)
                self.metrics.requests.labels(outcome="miss").inc()
            else:
                outcome = "join" if entry.active else "hit"
                self.metrics.requests.labels(outcome=outcome).inc()
                entry.last_used_at = now()
            handle = self._handles.get(request.name)
            if handle is None or (handle.key, handle.link) != (key, request.link):
                handle = Handle(request.name, key, request_key, request.link)
                self._handles[request.name] = handle
                await run_io(self._store.save_handle, handle)
            if request.lease is not None:
                await self._add_lease(handle, request.lease)
            if entry.state == State.READY:
                # Inside the lock: nothing evicts the entry between this answer and its link.
                await self._save(entry)  # last_used_at
                if handle.link:
                    await self._make_request_link(handle.link, entry)
            return self._view(handle), entry.state == State.READY

    async def _make_request_link(self, link: str, entry: Entry) -> None:
        try:
            await run_io(make_link, Path(link), self._final(entry))
        except OSError as exc:
            raise BadRequest(
                f"link {link} could not be created ({exc.strerror}); choose a --link path "
                "in a folder the daemon's user can write"
            ) from exc

    def _check_name(self, name: str, request_key: str) -> None:
        handle = self._handles.get(name)
        if handle is None or handle.spec_key == request_key:
            return
        other = self._entries[handle.key]
        if other.active or other.state == State.READY:
            raise Conflict(
                f"dataset name {name!r} is already used by a different request "
                f"(state {other.state}); DELETE /v1/datasets/{name} first or choose another name"
            )

    async def _admit(self, estimate: int, key: str) -> None:
        """Make room for a new staging, evicting LRU entries, or refuse it with the sizes."""
        # Trees being deleted will be free space in a moment; count them as free now, or
        # every request during a large deletion would evict more than it needs.
        free = await run_io(preflight.free_bytes, self.settings) + self._freeing_bytes
        plan = cache.plan_admission(
            needed=estimate,
            entries=list(self._entries.values()),
            protected=self._protected() | {key},
            capacity_bytes=self.settings.capacity_bytes,
            free_bytes=free,
            min_free_bytes=self.settings.min_free_bytes,
        )
        for victim in plan:
            log.info("evicting %s (%d bytes) to admit %s", victim.key, victim.size_bytes, key)
            await self._evict(victim)

    def _protected(self) -> set[str]:
        """Keys eviction must not touch: leased, or being staged."""
        leased = {lease.key for lease in self._leases.values()}
        return leased | {k for k, e in self._entries.items() if e.active}

    async def _enqueue(
        self,
        entry: Entry | None,
        key: str,
        request: DatasetCreate,
        expansion: recipes.Expansion,
        estimate: int,
    ) -> Entry:
        if entry is None:
            entry = Entry(
                key=key,
                spec=request.spec(),
                steps=expansion.steps,
                verify=request.verify,
                usage=expansion.usage,
            )
            self._entries[key] = entry
        else:
            entry.move(State.QUEUED)
            entry.last_used_at = now()
        entry.progress = Progress(step_names=[s.op for s in entry.steps])
        entry.estimate_bytes = estimate
        await self._save(entry)
        self._queue.put_nowait(key)
        return entry

    def get(self, name: str) -> DatasetPublic:
        return self._view(self._handle(name))

    def list(self) -> list[DatasetPublic]:
        return [self._view(h) for h in sorted(self._handles.values(), key=lambda h: h.name)]

    async def wait(self, name: str, timeout: float) -> DatasetPublic:
        """Long-poll: return once the dataset is terminal or ``timeout`` has passed."""
        handle = self._handle(name)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        async with self._changed:
            while self._entries[handle.key].active and not self._stopping:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    await asyncio.wait_for(self._changed.wait(), remaining)
                except TimeoutError:
                    break
        return self._view(handle)

    async def watch(self, name: str, interval: float = 0.5) -> AsyncIterator[DatasetPublic]:
        """Statuses for server-sent events: on every change, at most every ``interval``."""
        handle = self._handle(name)
        last = None
        while True:
            view = self._view(handle)
            snapshot = (view.state, view.progress)
            if snapshot != last:
                last = snapshot
                yield view
            if view.state.terminal or self._stopping:
                return
            async with self._changed:
                try:
                    await asyncio.wait_for(self._changed.wait(), interval)
                except TimeoutError:
                    pass

    async def delete(self, name: str) -> DatasetPublic:
        """Cancel if staging, evict if ready, forget the name if already finished."""
        async with self._admission:
            handle = self._handle(name)
            entry = self._entries[handle.key]
            holders = sorted(
                {lease.holder for lease in self._leases.values() if lease.key == entry.key}
            )
            shared = any(h.key == entry.key and h.name != name for h in self._handles.values())
            if shared or not (entry.active or entry.state == State.READY):
                view = self._view(handle)
                await self._forget(handle)
                return view
            if holders:
                raise Conflict(
                    f"dataset {name!r} is leased by {', '.join(holders)}; release it first "
                    f"(stager-client release {name}) or wait for those jobs to end"
                )
            if entry.state == State.QUEUED:
                entry.move(State.CANCELLED, CANCELLED_BY_REQUEST)
                await self._save(entry)
            elif entry.state == State.STAGING:
                entry.cancel.set()
            else:
                await self._evict(entry)
        if entry.state == State.STAGING:  # outside the lock: stopping may take a moment
            await self.wait(name, self.settings.shutdown_timeout_s)
        return self._view(handle)

    async def _evict(self, entry: Entry) -> None:
        """Evict a ready entry; the caller holds ``_admission``.

        Order matters for crashes: the state store says "evicted" first, so a half-gone
        tree is never reported ready; then one rename takes the tree out of ``data/``;
        the slow delete of a million files runs afterwards, off the lock.
        """
        entry.move(State.EVICTED)
        await self._save(entry)
        final = self._final(entry)
        for handle in self._handles.values():
            if handle.key == entry.key and handle.link:
                await run_io(remove_link, Path(handle.link), final)
        trash = await run_io(discard, final, self.settings.partial_dir)
        self.metrics.evictions.inc()
        self.metrics.evicted_bytes.inc(entry.size_bytes)
        if trash is not None:
            self._delete_in_background(trash, entry.size_bytes)

    def _delete_in_background(self, path: Path, nbytes: int) -> None:
        """Delete ``path`` off the lock; ``nbytes`` counts as free space meanwhile."""
        self._freeing_bytes += nbytes
        self._spawn(self._delete(path, nbytes), f"delete-{path.name}")

    async def _delete(self, path: Path, nbytes: int) -> None:
        # Whatever is not deleted (a stop, an error) is an orphan the next start removes.
        try:
            await run_io(delete_tree, path, self._halt)
        except OSError as exc:
            log.error("could not delete %s: %s", path, exc)
        finally:
            self._freeing_bytes -= nbytes

    async def _forget(self, handle: Handle) -> None:
        del self._handles[handle.name]
        await run_io(self._store.delete_handle, handle.name)
        for lease in [lease for lease in self._leases.values() if lease.name == handle.name]:
            await self._drop_lease(lease)

    # ---- leases --------------------------------------------------------------

    async def lease(self, name: str, request: LeaseCreate) -> LeasePublic:
        handle = self._handle(name)
        async with self._admission:
            lease = await self._add_lease(handle, request)
        return lease.public()

    async def _add_lease(self, handle: Handle, request: LeaseCreate) -> Lease:
        # One lease per holder and dataset: a re-run of the same job step renews it.
        for old in list(self._leases.values()):
            if old.name == handle.name and old.holder == request.holder:
                await self._drop_lease(old)
        lease = Lease.create(handle.name, handle.key, request)
        self._leases[lease.id] = lease
        await run_io(self._store.save_lease, lease)
        entry = self._entries[handle.key]
        entry.last_used_at = now()  # a new lease is a use: it moves the entry back in LRU order
        await self._save(entry)
        return lease

    async def release(
        self, name: str, lease_id: str | None = None, holder: str | None = None
    ) -> list[LeasePublic]:
        """Drop one lease by id, or every lease of ``holder`` (or all) on this dataset."""
        self._handle(name)
        chosen = [
            lease
            for lease in self._leases.values()
            if lease.name == name
            and (lease_id is None or lease.id == lease_id)
            and (holder is None or lease.holder == holder)
        ]
        if lease_id is not None and not chosen:
            raise NotFound(f"dataset {name!r} has no lease {lease_id!r}")
        for lease in chosen:
            await self._drop_lease(lease)
        return [lease.public() for lease in chosen]

    async def release_holder(self, holder: str) -> list[LeasePublic]:
        """Drop every lease of one holder on any dataset (a job's epilog)."""
        chosen = [lease for lease in self._leases.values() if lease.holder == holder]
        for lease in chosen:
            await self._drop_lease(lease)
        return [lease.public() for lease in chosen]

    async def _drop_lease(self, lease: Lease) -> None:
        self._leases.pop(lease.id, None)
        await run_io(self._store.delete_lease, lease.id)

    # ---- sweeping --------------------------------------------------------------

    async def gc(self, request: GcRequest) -> GcResult:
        """Drop dead leases; evict unnamed (superseded) entries, or every unleased one."""
        dropped = await self._drop_dead_leases()
        async with self._admission:
            named = {h.key for h in self._handles.values()}
            protected = self._protected()
            victims = [
                e
                for e in cache.evictable(self._entries.values(), protected)
                if request.all or e.key not in named
            ]
            for victim in victims:
                await self._evict(victim)
        return GcResult(
            evicted=[v.key for v in victims],
            freed_bytes=sum(v.size_bytes for v in victims),
            leases_dropped=dropped,
        )

    async def _drop_dead_leases(self) -> int:
        dropped = 0
        for lease in list(self._leases.values()):
            alive = (
                None
                if lease.slurm_job_id is None
                else await run_io(slurm.job_alive, lease.slurm_job_id)
            )
            if lease.expired() or alive is False:
                log.info(
                    "dropping lease %s of %s (%s)",
                    lease.id,
                    lease.holder,
                    "expired" if lease.expired() else "job ended",
                )
                await self._drop_lease(lease)
                dropped += 1
        return dropped

    async def _sweep(self) -> None:
        """Now and then: drop leases of ended jobs, and shrink back under the capacity."""
        while True:
            await asyncio.sleep(self.settings.sweep_interval_s)
            try:
                await self._drop_dead_leases()
                async with self._admission:
                    await self._admit(0, "")
            except InsufficientSpace:
                pass  # over the limit with everything leased: nothing more can go now
            except (OSError, StagerError) as exc:
                log.error("cache sweep failed: %s", exc)

    def _handle(self, name: str) -> Handle:
        handle = self._handles.get(name)
        if handle is None:
            raise NotFound(f"no dataset named {name!r}; GET /v1/datasets lists the known ones")
        return handle

    def _view(self, handle: Handle) -> DatasetPublic:
        leases = [lease.public() for lease in self._leases.values() if lease.name == handle.name]
        return public_view(handle, self._entries[handle.key], self.settings.data_dir, leases)

    def _final(self, entry: Entry) -> Path:
        return self.settings.data_dir / entry.key

    def _partial(self, entry: Entry) -> Path:
        return self.settings.partial_dir / entry.key

    def entries(self) -> list[Entry]:
        return list(self._entries.values())

    # ---- staging -----------------------------------------------------------

    async def _worker(self) -> None:
        while True:
            key = await self._queue.get()
            entry = self._entries.get(key)
            if entry is None or entry.state != State.QUEUED or self._stopping:
                continue
            try:
                await self._stage(entry)
            except Exception:
                # The state store failed under us (disk full, database locked): this entry
                # is lost to this run, but the worker must live on for the queue's sake.
                log.exception("could not record the outcome of staging %s", entry.key)
                if entry.active:  # waiters must not hang on it; a restart retries it
                    entry.move(State.FAILED, STATE_STORE_FAILED)
                    async with self._changed:
                        self._changed.notify_all()

    async def _stage(self, entry: Entry) -> None:
        entry.cancel.clear()
        entry.move(State.STAGING)
        await self._save(entry)
        job = StageJob(
            steps=self.ops.dump_steps(entry.steps),
            op_modules=tuple(self.settings.op_modules),
            allowed_roots=tuple(self.settings.allowed_roots),
            partial=self._partial(entry),
            final=self._final(entry),
            workers=self.settings.op_workers,
            verify=entry.verify,
            nice=self.settings.staging_nice,
        )
        future = asyncio.ensure_future(run_staging(job, entry.progress, entry.cancel))
        self._running.add(future)
        try:
            entry.size_bytes = await future
        except Cancelled:
            if self._stopping:
                return  # left in STAGING on disk; resumed when the daemon starts again
            await self._fail(entry, State.CANCELLED, CANCELLED_BY_REQUEST)
        except StagerError as exc:
            await self._fail(entry, State.FAILED, ErrorInfo(**exc.to_dict()))
        except OSError as exc:
            error = from_os_error(exc, "staging")
            await self._fail(entry, State.FAILED, ErrorInfo(**error.to_dict()))
        except Exception as exc:
            # A bug must fail this dataset loudly, not wedge it in STAGING.
            log.exception("internal error while staging %s", entry.key)
            message = f"internal error while staging: {exc!r}; see the daemon log"
            await self._fail(entry, State.FAILED, ErrorInfo(type="internal_error", message=message))
        else:
            # Links first: whoever the save wakes may use the link at once.
            await self._link_all(entry)
            entry.move(State.READY)
            self.metrics.staged_bytes.inc(entry.size_bytes)
            await self._save(entry)
        finally:
            self._running.discard(future)

    async def _fail(self, entry: Entry, state: State, error: ErrorInfo) -> None:
        log.warning("dataset %s %s: %s", entry.key, state, error.message)
        for path in (self._partial(entry), steps_marker(self._partial(entry))):
            try:
                trash = await run_io(discard, path, self.settings.partial_dir)
            except OSError as exc:
                log.error("could not remove partial data of %s: %s", entry.key, exc)
                continue
            if trash is not None:
                self._delete_in_background(trash, 0)
        entry.move(state, error)
        self.metrics.failures.labels(type=error.type).inc()
        await self._save(entry)

    async def _link_all(self, entry: Entry) -> None:
        for handle in list(self._handles.values()):
            if handle.key == entry.key and handle.link:
                try:
                    await run_io(make_link, Path(handle.link), self._final(entry))
                except OSError as exc:
                    log.error("could not create link %s: %s", handle.link, exc)

    async def _save(self, entry: Entry) -> None:
        await run_io(self._store_entry_sync, entry)
        async with self._changed:
            self._changed.notify_all()

    def _store_entry_sync(self, entry: Entry) -> None:
        self._store.save_entry(entry)

    async def _flush_progress(self) -> None:
        """Persist progress now and then so a restarted daemon shows where it was."""
        while True:
            await asyncio.sleep(self.settings.progress_flush_s)
            staging = [e for e in self._entries.values() if e.state == State.STAGING]
            if staging:
                await run_io(self._store.save_progress, staging)
                async with self._changed:
                    self._changed.notify_all()


def state_counts(engine: Engine) -> dict[str, int]:
    counts = {state.value: 0 for state in State}
    for entry in engine.entries():
        counts[entry.state.value] += 1
    return counts
