"""The staging engine: admits requests, schedules stagings, answers about them.

What it decides: whether a request joins, hits or starts a staging (``submit``),
with :mod:`stager.engine.admission` making room (by :mod:`stager.state.cache`'s policy) and
handing out slots fairly between users, when a queued entry runs (``_worker``),
and what becomes of a finished staging (``_stage``). Every change it decides on is
made by the registry (:mod:`stager.engine.lifecycle`), which persists it. A staging
itself runs in a child process of its own (:mod:`stager.staging.worker`), awaited
without blocking the loop.

Entries, names and leases are read and changed on the event loop only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from stager.core import slurm
from stager.core.durable import CrashPoints
from stager.core.errors import (
    Cancelled,
    Conflict,
    Forbidden,
    InsufficientSpace,
    NotFound,
    NotPublic,
    StagerError,
    from_os_error,
)
from stager.core.identity import Caller
from stager.core.metrics import Metrics
from stager.core.settings import Settings
from stager.engine.admission import Admission, owner_of
from stager.engine.lifecycle import Registry, Trash
from stager.fanout.room import FanoutRoom
from stager.fs.credentials import Reader, reader_of
from stager.kinds.table import Kinds
from stager.ops import table
from stager.request import preflight, recipes
from stager.staging.blocking import INTERNAL, Limits, Processes, run_io, run_staging
from stager.staging.worker import StageJob, WriteBound, past_inode_bound
from stager.state import cache
from stager.state.dataset import (
    CANCELLED_BY_REQUEST,
    Ask,
    Entry,
    Handle,
    private_key,
    public_origin,
    public_view,
    spec_key,
)
from stager.state.layout import Layout
from stager.state.leases import Lease
from stager.state.store import Store
from stager.wire.schemas import (
    Adopt,
    DatasetCreate,
    DatasetPublic,
    ErrorInfo,
    ExportCreate,
    ExportPublic,
    GcRequest,
    GcResult,
    LeaseCreate,
    LeasePublic,
    ProbeResult,
    State,
)
from stager.wire.suggest import did_you_mean

log = logging.getLogger("stager.engine.scheduler")

STATE_STORE_FAILED = ErrorInfo(
    type="internal_error",
    message="the daemon could not record this staging in its state database; see the daemon "
    "log, check the cache disk, then stage again",
)


@dataclass(frozen=True)
class Resolved:
    """A request, resolved: its steps, the key of its spec alone, its cache key, the
    key it would have if every user shared it, and whose rights it is read with."""

    expansion: recipes.Expansion
    request_key: str
    key: str
    shared_key: str
    reader: Reader | None
    # What the request is given other than it asked (a tree for an image), in a sentence.
    notice: str | None = None
    # The spec it is staged by (``image`` as decided: asked, implied or fallen back).
    spec: dict[str, Any] | None = None


class Engine:
    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.ops = table.for_settings(settings)
        self.registry: Registry | None = None
        # Room and slots (stager.engine.admission); its lock is held by whatever decides an
        # entry's fate: admission, joins and hits, leases, eviction.
        self.admission = Admission(settings)
        self._admission = self.admission.lock
        self._tasks: set[asyncio.Task[Any]] = set()  # kept so they are not garbage-collected
        self._running: set[asyncio.Future[Any]] = set()
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self.started = False
        # What differs between a tree and an image (stager.kinds), asked, never tested.
        self.kinds = Kinds(settings)
        # Every process the daemon starts (stager.core.processes), and who acts for a user.
        self.processes = Processes(
            separate_users=settings.multi_user, users_timeout_s=settings.user_process_timeout_s
        )
        # Multi-node fan-out (docs/multinode.md): room on the disk that broadcasts take.
        self.fanout = FanoutRoom(settings, self.ops, self.admission, self.as_user)
        # The job a user's data was pre-staged for (stager.prestage.prefetch sets it), for status.
        self.prestaged: Callable[[int, str], int | None] = lambda uid, key: None

    @property
    def _reg(self) -> Registry:
        assert self.registry is not None, "the engine has not started"
        return self.registry

    # ---- start and stop -----------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self.processes.start()
        await run_io(preflight.ensure_dirs, self.settings)
        store = await run_io(Store, self.settings.db_path, self.ops)
        trash = Trash(self.settings.partial_dir, self._spawn)
        self._crash = CrashPoints(self.settings.crash_after)
        layout = await run_io(Layout.load, self.settings, self.kinds.mounted)
        self.registry = Registry(
            self.settings,
            store,
            self.metrics,
            trash,
            self._crash,
            self.as_user,
            self.kinds,
            layout,
        )
        self.admission.bind(self.registry, self.fanout.held, lambda: self.fanout.exporting)
        for entry in await self._reg.load():
            self._queue(entry)
        # Deliveries and exports of an earlier run: nobody will adopt or send them now.
        await self.fanout.clear_deliveries()
        for leftover in await run_io(lambda: list(self.settings.outgoing_dir.iterdir())):
            await self._reg.trash.discard(leftover)  # exports: the service's own folders
        try:
            # Recipe files are re-read per request; checking them now tells the admin early.
            await run_io(recipes.recipe_files, self.settings)
        except StagerError as exc:
            log.error("%s; requests naming a recipe will fail until it is fixed", exc.message)
        for i in range(self.settings.max_workers):
            self._spawn(self._worker(), f"worker-{i}")
        self._spawn(self._flush_progress(), "progress-flusher")
        self._spawn(self._sweep(), "cache-sweeper")
        self._spawn(self._sweep_transfers(), "transfer-sweeper")
        self.started = True

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
        if self.registry is None:
            return
        self._reg.trash.halt.set()
        for entry in self._reg.entries.values():
            if entry.state == State.STAGING:
                entry.cancel.set()
        self._spawn(self._reg.notify(), "wake-waiters")

    async def stop(self) -> None:
        """Stop accepting work; running stagings stay resumable and are resumed at start."""
        self._begin_stop()
        if self._running:
            await asyncio.wait(self._running, timeout=self.settings.shutdown_timeout_s)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.processes.close()
        self.kinds.close()
        if self.registry is not None:
            staging = [e for e in self._reg.entries.values() if e.active]
            await self._reg.save_progress(staging)
            await self._reg.close()

    async def as_user(self, uid_or_caller: Caller | int | None, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` with a user's rights (a caller, or a uid: a name's owner), its
        result as JSON data (stager.staging.blocking.Processes.run_as). Never awaited under the
        admission lock: a user's process may take its time, and others must not wait."""
        if uid_or_caller is None or not self.settings.multi_user:
            return await self.processes.run_as(None, fn, *args)
        caller = (
            uid_or_caller if isinstance(uid_or_caller, Caller) else Caller.of_uid(uid_or_caller)
        )
        return await self.processes.run_as(caller.identity, fn, *args)

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- requests ------------------------------------------------------------------

    async def _resolve(
        self, request: DatasetCreate, caller: Caller, naming: bool = True
    ) -> Resolved:
        """The request's steps, the key of its spec alone (decides name conflicts), its
        cache key (spec + sources' fingerprint; in the node service also whose it is),
        and whose rights its sources are read with. ``naming``: it takes its name."""
        if request.recipe:
            # Rendered here; whether its release files are there is the caller's to see.
            expansion = await run_io(recipes.expand, request, self.settings, False)
        else:
            expansion = recipes.Expansion(steps=request.steps)
        expansion.steps = self.ops.expand(expansion.steps)  # e.g. an extract of a URL
        kind = self.kinds.asked(request, expansion.steps, self.ops)
        request, notice = kind.check(request, expansion.steps, self.ops)
        spec = request.spec()
        request_key = spec_key(spec)
        if naming:  # early, before paying for a fingerprint
            self._check_name(request.name, caller.uid, request_key)
        reader = self._reader(caller)
        recipe = (request.recipe, request.params, request.source) if request.recipe else None
        found = await self.as_user(
            caller,
            preflight.look,
            self.ops.dump_steps(expansion.steps),
            self.settings,
            request.fingerprint == "deep",
            request.link if naming else None,
            recipe,
            request.adopt is not None and request.adopt.vouched,
        )
        fingerprint = str(found["fingerprint"])
        key = shared_key = spec_key({"spec": spec, "sources": fingerprint})
        if reader is not None:
            shared, cluster_wide = found["shareable"] is True, found["cluster_wide"] is True
            key, reader = self._scope(key, reader, shared, request.adopt, cluster_wide)
        return Resolved(expansion, request_key, key, shared_key, reader, notice, spec)

    def _reader(self, caller: Caller) -> Reader | None:
        """Whose rights a request's sources are read with: in the node service the
        caller's (root's too: its stagings are checked for sharing like anyone's)."""
        return reader_of(caller) if self.settings.multi_user else None

    def _scope(
        self, key: str, reader: Reader, shared: bool, adopt: Adopt | None, cluster_wide: bool
    ) -> tuple[str, Reader]:
        """Shared by every user (the key alone) when every source is readable by
        everyone, as the staging then checks file by file; else the caller's own copy.
        A shared staging of this key that met a file not everyone may read has failed
        with ``not_public``: until the sources change (and the key with them), it is
        staged privately. A broadcast copy is shared only when the origin node's
        service vouches for its manifest (stager.core.vouch), and only when every source lies
        where each node holds the same files (``cluster_wide``: the key, made of paths,
        sizes and times, is then the same data on both nodes); the job's own copies of
        the source files, hashed by the job, never are."""
        earlier = self._reg.entries.get(key)
        found_private = (
            earlier is not None
            and earlier.state == State.FAILED
            and earlier.error is not None
            and earlier.error.type == NotPublic.type
        )
        # Another user's adoption of this key under way: its delivery is theirs to
        # send, slowly or never, so nobody else waits on it (nor sees why it failed).
        adopting = (
            earlier is not None
            and earlier.active
            and earlier.reader is not None
            and earlier.reader.vouched
            and earlier.reader.uid != reader.uid
        )
        if shared and not found_private and not adopting:
            if adopt is None:
                return key, replace(reader, public=True)
            if adopt.vouched and adopt.sources is None and cluster_wide:
                return key, replace(reader, public=True, vouched=True)
        return private_key(key, reader.uid), reader

    async def probe(self, request: DatasetCreate, caller: Caller) -> ProbeResult:
        """This node's cache key for ``request`` and its copy, if any; changes nothing."""
        resolved = await self._resolve(request, caller, naming=False)
        expansion, key = resolved.expansion, resolved.key
        entry = self._reg.entries.get(key)
        return ProbeResult(
            key=key,
            state=entry.state.value if entry else None,
            size_bytes=entry.size_bytes if entry else 0,
            origin=public_origin(entry),
            source_files=await self.fanout.source_files(expansion.steps, caller),
            image=bool(resolved.spec.get("image")),
        )

    async def submit(self, request: DatasetCreate, caller: Caller) -> tuple[DatasetPublic, bool]:
        """Create or join a staging. Returns the status and whether it is already ready."""
        reg = self._reg
        resolved = await self._resolve(request, caller)
        expansion, key, reader = resolved.expansion, resolved.key, resolved.reader
        existing = reg.entries.get(key)
        if existing is not None and existing.state == State.READY:
            await self._drop_if_changed(existing)
        # Only a miss pays for validating sources and estimating the size (a walk).
        miss = existing is None or not (existing.active or existing.state == State.READY)
        arrival = await self.fanout.arrival(
            request, caller, expansion.steps, key, resolved.shared_key, reader, miss
        )
        if existing is not None and not miss:
            estimate = existing.estimate_bytes
        elif arrival.estimate is not None:
            estimate = arrival.estimate
        else:
            estimate = int(
                await self.as_user(
                    caller,
                    preflight.check_steps,
                    self.ops.dump_steps(expansion.steps),
                    request.verify,
                    self.settings,
                )
            )

        # The link first, as the caller and outside the lock (a user's process may take
        # its time): a link that cannot be made is a 400 that leaves nothing behind. It
        # names data/<key>, where this key's tree is whenever it is ready.
        linked = False
        if request.link and existing is not None and existing.state == State.READY:
            await reg.link(request.link, caller, existing)
            linked = True

        # Decide under one lock: concurrent identical requests must see each other's entry.
        async with self._admission:
            self._check_name(request.name, caller.uid, resolved.request_key)  # another may have won
            self.admission.check_prefetch(estimate)
            entry = reg.entries.get(key)
            if entry is None or entry.state in (State.FAILED, State.CANCELLED, State.EVICTED):
                self.admission.check_queue(caller.uid)
                await self.admission.make_room(
                    estimate, key, None if reader is None or reader.public else caller.uid
                )
                entry = entry or Entry(key=key, spec=resolved.spec or {}, steps=[], verify="")
                # Asked for again: this request's steps (an adoption's, or the source's).
                ask = Ask(
                    steps=arrival.steps,
                    verify=request.verify,
                    usage=expansion.usage,
                    origin=arrival.origin,
                    delivery=arrival.delivery,
                    estimate_bytes=estimate,
                    reader=reader,
                    asked_as=(caller.uid, request.name),
                )
                await reg.queue(entry, ask)
                self.admission.queue.put(key, owner_of(entry))
                self.metrics.requests.labels(outcome="miss").inc()
            else:
                outcome = "join" if entry.active else "hit"
                if entry.state == State.QUEUED and reader is not None:
                    self.admission.queue.put(key, caller.uid)  # it waits in their turn too
                self.metrics.requests.labels(outcome=outcome).inc()
                if outcome == "hit":
                    self.metrics.arrivals.labels(how="hit").inc()
                    self.metrics.hit_bytes.inc(entry.size_bytes)
                await reg.touch(entry)
            hit = entry.state == State.READY
            handle = reg.handles.get((caller.uid, request.name))
            if (
                handle is None
                or handle.ended is not None
                or (handle.key, handle.link) != (key, request.link)
            ):
                handle = Handle(
                    request.name, key, resolved.request_key, caller.uid, request.link, hit=hit
                )
                await reg.name(handle)
            elif handle.hit != hit:
                await reg.note_hit(handle, hit)
            if request.lease is not None:
                await reg.lease(handle, request.lease)
        if request.link and not linked and entry.state == State.READY:
            await reg.link(request.link, caller, entry)  # it became ready meanwhile
        await self.fanout.admitted(arrival, entry)
        view = self._view(handle)
        view.notice = resolved.notice
        return view, entry.state == State.READY

    async def _drop_if_changed(self, entry: Entry) -> None:
        """A ready dataset changed since its publish is never served as it is: it is
        evicted, leased or not, and the request stages it again (what is checked is
        its kind's: a tree's seal, an image's file and mount)."""
        kind = self.kinds.of(entry)
        changed = await kind.changed(
            entry, self._reg, self._admission, self.processes.run_in_walker
        )
        if changed is None:
            return
        async with self._admission:
            if entry.state != State.READY:
                return  # another request found it first
            self.metrics.requests.labels(outcome="changed").inc()
            await self._reg.evict(
                entry, f"changed since it was published ({changed}); staged again"
            )

    def _check_name(self, name: str, owner: int, request_key: str) -> None:
        handle = self._reg.handles.get((owner, name))
        if handle is None or handle.ended is not None or handle.spec_key == request_key:
            return
        other = self._reg.entries[handle.key]
        if other.active or other.state == State.READY:
            raise Conflict(
                f"dataset name {name!r} is already used by a different request "
                f"(state {other.state}); DELETE /v1/datasets/{name} first, or choose another name"
            )

    # ---- fan-out: exports and deliveries (docs/multinode.md) ---------------------------

    async def export(self, name: str, request: ExportCreate, caller: Caller) -> ExportPublic:
        """Pack part ``request.part`` of dataset ``name`` for sbcast: of its ready tree
        (the first part plans them, and the last one comes with the manifest), or with
        ``early`` of the tree it is still staging (docs/multinode.md)."""
        entry = self._reg.entries[self._handle(name, caller).key]
        if request.early:
            await self._reg.note_feeding(entry)
        staging = entry.state == State.STAGING and entry.attempt is not None
        tree = self._reg.attempt(entry).tree if staging else None
        ready = partial(self._ready_tree, name=name)
        whole = self.kinds.of(entry).export
        return await self.fanout.export(entry, request, caller, tree, ready, whole)

    async def _ready_tree(self, entry: Entry, name: str) -> Path:
        """The published tree of ``entry`` (dataset ``name``), to be sent: only a ready
        one, unchanged since its publish (a changed tree is never sent either)."""
        if entry.state == State.READY:
            await self._drop_if_changed(entry)
        if entry.state != State.READY:
            raise Conflict(
                f"dataset {name!r} is {entry.state}, not ready; only a ready dataset can be sent"
            )
        return self._reg.final(entry)

    def get(self, name: str, caller: Caller, owner: int | None = None) -> DatasetPublic:
        return self._view(self._handle(name, caller, owner))

    def list(self, caller: Caller) -> list[DatasetPublic]:
        """The caller's own names; root's list holds every user's."""
        handles = sorted(
            (h for h in self._reg.handles.values() if caller.is_root or h.owner == caller.uid),
            key=lambda h: (h.name, h.owner),
        )
        return [self._view(h) for h in handles]

    async def wait(
        self, name: str, timeout: float, caller: Caller, owner: int | None = None
    ) -> DatasetPublic:
        """Long-poll: return once the dataset is terminal or ``timeout`` has passed."""
        handle = self._handle(name, caller, owner)
        with self.metrics.waiting.track_inprogress():
            await self._until(
                lambda: handle.ended is None and self._reg.entries[handle.key].active, timeout
            )
        return self._view(handle)

    async def _until(self, going: Callable[[], bool], timeout: float) -> None:
        """Wait while ``going()`` holds, ``timeout`` seconds at most (or until a stop)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        changed = self._reg.changed
        async with changed:
            while going() and not self._stopping:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    await asyncio.wait_for(changed.wait(), remaining)
                except TimeoutError:
                    break

    async def watch(
        self, name: str, caller: Caller, owner: int | None = None, interval: float = 0.5
    ) -> AsyncIterator[DatasetPublic]:
        """Statuses for server-sent events: on every change, at most every ``interval``."""
        handle = self._handle(name, caller, owner)
        last = None
        while True:
            view = self._view(handle)
            snapshot = (view.state, view.progress)
            if snapshot != last:
                last = snapshot
                yield view
            if view.state.terminal or self._stopping:
                return
            async with self._reg.changed:
                try:
                    await asyncio.wait_for(self._reg.changed.wait(), interval)
                except TimeoutError:
                    pass

    async def delete(self, name: str, caller: Caller, owner: int | None = None) -> DatasetPublic:
        """Cancel if staging, evict if ready, forget the name if already finished. A name
        with a lease is refused (409) while its data is staging or ready: the lease is a
        job's promise that it stays. When other live names (any user's) show the same
        data, only this name goes: data stays while any of its names holds it. A name
        cancelled alone stays, ended: another name staging the same data later never
        revives it, nor counts it as wanting that data. The answer's ``outcome`` says
        what happened to the name and to the data."""
        reg = self._reg
        dropped: Entry | None = None
        async with self._admission:
            handle = self._handle(name, caller, owner)
            entry = reg.entries[handle.key]
            live = handle.ended is None and (entry.active or entry.state == State.READY)
            holders = sorted({x.holder for x in reg.leases.values() if x.handle_id == handle.id})
            if holders and live:
                raise Conflict(
                    f"dataset {name!r} is leased by {', '.join(holders)}, so it stays (the name "
                    f"and its data); release it first (stager-client release {name}) or wait "
                    "for those jobs to end"
                )
            wanting = [h for h in self._wanting(entry) if h.id != handle.id]
            others = len(wanting)
            if others or not live:
                view = self._view(handle)
                await reg.forget(handle)
                if live and not any(h.owner == handle.owner for h in wanting):
                    self.admission.queue.discard(entry.key, handle.owner)  # not in their turn
                if not live:
                    ended = handle.ended or entry.state
                    view.outcome = f"removed the name {name!r} ({ended.value} already)"
                else:
                    view.outcome = (
                        f"removed the name {name!r}; its data stays ({entry.state.value}): "
                        f"{others} other name(s) on this node use it"
                    )
                return view
            await reg.end_name(handle, State.CANCELLED if entry.active else State.EVICTED)
            if entry.state == State.QUEUED:
                await reg.end(entry, State.CANCELLED, CANCELLED_BY_REQUEST)
                self.admission.queue.discard(entry.key)
                dropped = entry
                outcome = f"cancelled {name!r} before it started; nothing was staged"
            elif entry.state == State.STAGING:
                entry.cancel.set()
                outcome = f"cancelled the staging of {name!r}; its partial data is deleted"
            else:
                await reg.evict(entry, "on request (stager-client cancel)")
                outcome = f"evicted {name!r}: its data is deleted from this node's cache"
        if dropped is not None:
            await self._drop_claimed(dropped)  # its owner deletes it: outside the lock
        await reg.links_removed(entry)
        if entry.state == State.STAGING:  # outside the lock: its process may take a moment
            grace = self.settings.cancel_grace_s + 2.0
            timeout = max(grace, self.settings.shutdown_timeout_s)
            await self._until(lambda: entry.state == State.STAGING, timeout)
        view = self._view(handle)
        view.outcome = outcome
        return view

    # ---- leases ----------------------------------------------------------------------

    async def lease(
        self, name: str, request: LeaseCreate, caller: Caller, owner: int | None = None
    ) -> LeasePublic:
        handle = self._handle(name, caller, owner)
        async with self._admission:
            # Under the lock: a cancel that lands between a look and the lease would
            # leave a lease pinning a cancelled name's entry.
            if handle.ended is not None:
                raise Conflict(
                    f"dataset {name!r} was {handle.ended.value} by its owner; stage it again "
                    "before leasing it"
                )
            lease = await self._reg.lease(handle, request)
        return lease.public()

    async def release(
        self,
        name: str,
        caller: Caller,
        lease_id: str | None = None,
        holder: str | None = None,
        owner: int | None = None,
    ) -> list[LeasePublic]:
        """Drop one lease by id, or every lease of ``holder`` (or all) on this dataset."""
        handle = self._handle(name, caller, owner)
        chosen = [
            lease
            for lease in self._reg.leases.values()
            if lease.handle_id == handle.id
            and (lease_id is None or lease.id == lease_id)
            and (holder is None or lease.holder == holder)
        ]
        if lease_id is not None and not chosen:
            raise NotFound(f"dataset {name!r} has no lease {lease_id!r}")
        return await self._release(chosen)

    async def release_holder(self, holder: str, caller: Caller) -> list[LeasePublic]:
        """Drop every lease of one holder on any of the caller's datasets (root: on any
        user's; a job's epilog runs as root)."""
        return await self._release(
            [
                x
                for x in self._reg.leases.values()
                if x.holder == holder and (caller.is_root or x.owner == caller.uid)
            ]
        )

    async def _release(self, leases: list[Lease]) -> list[LeasePublic]:
        for lease in leases:
            await self._reg.release(lease)
        return [lease.public() for lease in leases]

    # ---- sweeping --------------------------------------------------------------------

    async def gc(self, request: GcRequest, caller: Caller) -> GcResult:
        """Drop dead leases; evict unnamed (superseded) entries, or every unleased one
        (in the node service only root may: other users' data is not the caller's). In
        the node service a user's gc touches only their own: their dead leases, their
        own private copies that no name shows; shared entries belong to nobody, and are
        root's to collect (and the cache's to evict for room)."""
        if request.all and self.settings.multi_user and not caller.is_root:
            raise Forbidden(
                "only root may evict every unleased dataset of the node service; "
                "DELETE your own datasets instead"
            )
        mine = self.settings.multi_user and not caller.is_root
        dropped = await self._drop_dead_leases(caller.uid if mine else None)
        async with self._admission:
            # Only live names keep an entry: one that only ended names show is superseded.
            named = {h.key for h in self._reg.handles.values() if h.ended is None}
            victims = [
                e
                for e in cache.evictable(self.entries(), self.admission.protected())
                if (request.all or e.key not in named)
                and (not mine or cache.private_owner(e) == caller.uid)
            ]
            why = "by gc --all" if request.all else "by gc: no name refers to it any more"
            for victim in victims:
                await self._reg.evict(victim, why)
        return GcResult(
            evicted=[v.key for v in victims],
            freed_bytes=sum(v.size_bytes for v in victims),
            leases_dropped=dropped,
        )

    async def _drop_dead_leases(self, owner: int | None = None) -> int:
        """Drop leases past their time or their job (``owner``: that user's alone)."""
        leases = [x for x in self._reg.leases.values() if owner is None or x.owner == owner]
        # SLURM is asked once per job, not per lease, and about every job at once: one
        # slow answer must not hold a sweep for minutes.
        jobs = sorted({x.slurm_job_id for x in leases if x.slurm_job_id is not None})
        answers = await asyncio.gather(*(run_io(slurm.job_alive, job) for job in jobs))
        alive_by_job = dict(zip(jobs, answers, strict=True))
        dropped = 0
        for lease in leases:
            alive = alive_by_job.get(lease.slurm_job_id) if lease.slurm_job_id else None
            if lease.expired() or alive is False:
                why = "expired" if lease.expired() else "job ended"
                log.info("dropping lease %s of %s (%s)", lease.id, lease.holder, why)
                await self._reg.release(lease)
                dropped += 1
        return dropped

    async def _sweep_transfers(self) -> None:
        """Now and then: transfers past their time or their room, removed as their owners
        (a loop of its own, each owner's sweep a task of its own: an owner whose process
        does not answer delays only their own deliveries' sweep)."""
        await self._every_sweep("transfer sweep", partial(self.fanout.expire, self._spawn))

    async def _sweep(self) -> None:
        """Now and then: drop leases of ended jobs, take space evicted datasets held and
        let go of off their owners' books, and shrink back under the capacity."""

        async def shrink() -> None:
            await self._drop_dead_leases()
            await self._reg.sweep_held()
            try:
                async with self._admission:
                    await self.admission.make_room(0, "")
            except InsufficientSpace:
                pass  # over the limit with everything leased: nothing more can go now

        await self._every_sweep("cache sweep", shrink)

    async def _every_sweep(self, what: str, sweep: Callable[[], Awaitable[None]]) -> None:
        """``sweep`` every ``sweep_interval_s``, for the daemon's life: a round that fails
        is logged, and the next one runs all the same."""
        while True:
            await asyncio.sleep(self.settings.sweep_interval_s)
            try:
                await sweep()
            except (OSError, StagerError) as exc:
                log.error("%s failed: %s", what, exc)
            except Exception:  # noqa: BLE001 - the sweep must outlive any one round's bug
                log.exception("%s failed; it runs again in the next round", what)

    def _handle(self, name: str, caller: Caller, owner: int | None = None) -> Handle:
        """The caller's handle ``name``; root may name another user's with ``owner``."""
        if owner is not None and owner != caller.uid and not caller.is_root:
            raise Forbidden(
                f"dataset names of uid {owner} are theirs; only root may act on another "
                "user's datasets (leave out owner)"
            )
        handle = self._reg.handles.get((caller.uid if owner is None else owner, name))
        if handle is None:
            whose = caller.uid if owner is None else owner
            known = [n for (uid, n) in self._reg.handles if uid == whose]
            raise NotFound(
                f"no dataset named {name!r}; {did_you_mean(name, known)}"
                "GET /v1/datasets lists the known ones"
            )
        return handle

    def _view(self, handle: Handle) -> DatasetPublic:
        reg = self._reg
        leases = [x.public() for x in reg.leases.values() if x.handle_id == handle.id]
        entry = reg.entries[handle.key]
        view = public_view(handle, entry, reg.final(entry), leases)
        view.prestaged_for_job = self.prestaged(handle.owner, handle.key)
        return view

    def entries(self) -> list[Entry]:
        return list(self._reg.entries.values()) if self.registry else []

    # ---- staging ---------------------------------------------------------------------

    async def _worker(self) -> None:
        while True:
            key, owner = await self.admission.queue.get()
            try:
                entry = self._reg.entries.get(key)
                if entry is None or entry.state != State.QUEUED or self._stopping:
                    continue
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
                    await self._reg.fail_unrecorded(entry, STATE_STORE_FAILED)
                finally:
                    self._running.discard(staging)
            finally:
                self.admission.queue.finished(owner)

    async def _stage(self, entry: Entry) -> None:
        reg = self._reg
        attempt = await reg.start(entry)
        room_left, bound = await self._room_left(entry)
        inodes_left, inode_bound, disk_inodes = await self._inodes_left(entry)
        job = StageJob(
            steps=self.ops.dump_steps(entry.steps),
            op_modules=tuple(self.settings.op_modules),
            attempt=attempt,
            final=reg.final(entry),
            workers=self.settings.op_workers,
            verify=entry.verify,
            allowed_roots=self.fanout.staging_starts(entry),
            reader=entry.reader,
            nice=self.settings.staging_nice,
            crash_after=self._crash.for_staging_process(),
            write_bytes=room_left,
            write_bound=bound,
            write_inodes=inodes_left,
            inode_bound=inode_bound,
            kind=self.kinds.of(entry).job(entry),
        )
        # The staging stops itself at its room's end; the daemon checks too (a slack of
        # what one poll of its counters may see written past it).
        shared = self._inodes_shared(entry, disk_inodes)
        limits = Limits.of(self.settings, room_left, bound, inodes_left, inode_bound, shared)
        future = asyncio.ensure_future(
            run_staging(job, self.processes, entry.progress, entry.cancel, limits)
        )
        try:
            try:
                seal = await future
            finally:
                await self._drop_claimed(entry)  # read once: gone before ready is said
        except NotPublic as exc:
            # Names move to their owners' own stagings first, so that nobody waiting on
            # them is woken by this failure: it is not theirs.
            await self._stage_privately(entry)
            await reg.end(entry, State.FAILED, ErrorInfo(**exc.to_dict()))
        except Cancelled:
            if self._stopping:
                await reg.interrupt(entry)  # resumed when the daemon starts again
            elif self._wanting(entry):
                # Another name joined while the cancel was under way: it never asked for
                # the cancel, so the staging goes on for it (resumed, as after a stop).
                await reg.interrupt(entry)
                self._queue(entry)
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

    def _wanting(self, entry: Entry) -> list[Handle]:
        """The names that want ``entry``: every name on it that its owner has not ended."""
        return [h for h in self._reg.handles.values() if h.key == entry.key and h.ended is None]

    def _queue(self, entry: Entry) -> None:
        """A queued entry waits in the turn of each user whose name wants it (node
        service: each of them asked for it), and is charged to one of them: never to a
        user who ended their name (the first asker, if they cancelled). With no live
        name (or one user's daemon), in the turn of the user it is read as."""
        if entry.state != State.QUEUED:
            return
        wanting = {h.owner for h in self._wanting(entry)} if self.settings.multi_user else set()
        low = self.admission.prefetch_only(entry.key)  # a prefetch's stays low
        for owner in sorted(wanting) or [owner_of(entry)]:
            self.admission.queue.put(entry.key, owner, low)

    async def _room_left(self, entry: Entry) -> tuple[int | None, WriteBound]:
        """The most bytes a staging of ``entry`` may write (None: no limit), and what sets
        it: for a user's own data, their quota less what their other data and their
        transfers hold ("quota"); and whatever its data, the room the disk has above its
        floor now, less what transfers were promised ("disk": a source that makes far
        more than its size said, shared or not, stops there, not at a full disk). What
        it writes is counted as it writes, not estimated."""
        held = await self.fanout.held()
        limits: list[tuple[int, WriteBound]] = []
        owner = cache.private_owner(entry)
        if owner is not None and self.settings.user_quota_bytes:
            others = [
                e for e in self.entries() if cache.private_owner(e) == owner and e is not entry
            ]
            used = (
                cache.used_bytes(others)
                + held.reserved_by.get(owner, 0)
                + self._reg.held.bytes_of(owner)
            )
            limits.append((self.settings.user_quota_bytes - used, "quota"))
        if self.settings.min_free_bytes:  # no floor: the disk's own end is the limit
            room = await self.admission.free_bytes(held) - self.settings.min_free_bytes
            limits.append((room, "disk"))
        if not limits:
            return None, "quota"
        return min(limits)

    async def _inodes_left(self, entry: Entry) -> tuple[int | None, WriteBound, int | None]:
        """The most inodes a staging of ``entry`` may make (None: no limit), and what
        sets it, as :meth:`_room_left` for bytes: its user's inode quota less what their
        other data holds (a tree its seal's entries, an image one, a staging what it made
        so far), and the disk's free inodes above its floor (also returned alone, None
        without a floor: :meth:`_inodes_shared`)."""
        limits: list[tuple[int, WriteBound]] = []
        owner = cache.private_owner(entry)
        if owner is not None and self.settings.user_inode_quota:
            used = sum(
                cache.inodes_held(e)
                for e in self.entries()
                if cache.private_owner(e) == owner and e is not entry
            )
            limits.append((self.settings.user_inode_quota - used, "quota"))
        disk = None
        if self.settings.min_free_inodes:
            free = await self.admission.free_inodes()
            if free is not None:
                disk = free - self.settings.min_free_inodes
                limits.append((disk, "disk"))
        if not limits:
            return None, "quota", disk
        left, bound = min(limits)
        return left, bound, disk

    def _inodes_shared(self, entry: Entry, disk_room: int | None) -> Callable[[], None] | None:
        """The daemon's check, at each look at a staging's counters, of the inode bounds
        it shares with the other stagings under way: each was given its room when it
        started, counting only what the others had made by then, so together they could
        pass it. Each counts, as they are now, the stagings that started before it (and
        every entry not being staged), not those that started after it: once they pass
        a bound together, the last to start is stopped, and only it. The bounds: its
        user's inode quota (her own entries), and the disk's room above its inode floor
        when it started (``disk_room``: what every entry made since)."""
        quota = self.settings.user_inode_quota
        owner = cache.private_owner(entry)
        mine = quota if owner is not None and quota else None
        if mine is None and disk_room is None:
            return None
        before = {e.key for e in self.entries() if e.active and e is not entry}

        def counted() -> list[Entry]:
            return [e for e in self.entries() if not e.active or e is entry or e.key in before]

        start = sum(cache.inodes_held(e) for e in counted())

        def check() -> None:
            entries = counted()
            if mine is not None:
                own = sum(cache.inodes_held(e) for e in entries if cache.private_owner(e) == owner)
                if own > mine:
                    raise past_inode_bound("quota", entry.progress.inodes_made)
            if disk_room is not None:
                if sum(cache.inodes_held(e) for e in entries) - start > disk_room:
                    raise past_inode_bound("disk", entry.progress.inodes_made)

        return check

    async def _stage_privately(self, shared: Entry) -> None:
        """A shared staging met a source not everyone may read: each name that waits on
        it gets its owner's own copy, staged with that owner's rights (which may refuse
        the file: then that one fails naming it)."""
        reg = self._reg
        async with self._admission:
            for handle in self._wanting(shared):  # a name its owner ended wants nothing
                owner = Caller.of_uid(handle.owner)
                key = private_key(shared.key, owner.uid)
                entry = reg.entries.get(key)
                if entry is None or entry.state in (State.FAILED, State.CANCELLED, State.EVICTED):
                    await self.admission.make_room(shared.estimate_bytes, key, owner.uid)
                    entry = entry or Entry(key=key, spec=shared.spec, steps=[], verify="")
                    ask = Ask(
                        steps=shared.steps,
                        verify=shared.verify,
                        usage=shared.usage,
                        origin=shared.origin,
                        estimate_bytes=shared.estimate_bytes,
                        reader=reader_of(owner),
                        asked_as=handle.id,
                    )
                    await reg.queue(entry, ask)
                    low = self.admission.is_prefetch(handle.id)
                    self.admission.queue.put(key, owner_of(entry), low)
                await reg.repoint(handle, entry)

    async def _drop_claimed(self, entry: Entry) -> None:
        """A delivery is read once: when its staging ends, whatever the outcome, it goes
        (after a stop too: a restart deletes deliveries, nobody could adopt it again)."""
        if entry.delivery is not None:
            await self._reg.drop_delivery(entry, self.fanout.staging_ends(entry))

    async def _flush_progress(self) -> None:
        """Persist progress now and then so a restarted daemon shows where it was."""
        while True:
            await asyncio.sleep(self.settings.progress_flush_s)
            staging = [e for e in self._reg.entries.values() if e.state == State.STAGING]
            if staging:
                await self._reg.save_progress(staging)
