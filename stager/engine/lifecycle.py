"""The life of cache entries, their names and leases: every change, in one place.

    queued -> staging -> ready | failed | cancelled
    staging -> queued          (the daemon stopped mid-staging: the same attempt resumes)
    ready -> evicted
    failed | cancelled | evicted -> queued   (asked for again: a new attempt)

``Registry`` is the only code that changes entries, handles (users' names) and
leases: in memory, then in the store, then waking waiters; one log line each.

An *attempt* keeps its data and its resume marker together in
``partial/<key>.<attempt>/`` (``tree/``, ``steps-done``), so a crash never pairs one
attempt's marker with another's data. Each durable step is a member of
``stager.core.durable.Durable``; ``tests/stager/test_crash_points.py`` kills the
daemon after each.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from stager.core import slurm
from stager.core.durable import CrashPoints, Durable
from stager.core.errors import BadRequest, StagerError
from stager.core.metrics import Metrics
from stager.core.settings import Settings
from stager.engine.held_space import HeldSpace
from stager.fs.deletion import delete_tree
from stager.fs.seal import Seal
from stager.image.published import ImageRecord
from stager.kinds.base import Outcome
from stager.kinds.table import Kinds
from stager.request.preflight import ensure_dirs
from stager.staging.blocking import run_io
from stager.staging.publish import (
    DISCARDED_PREFIX,
    Attempt,
    discard,
    make_link,
    remove_delivery,
    remove_link,
)
from stager.state.cache import private_owner
from stager.state.dataset import Ask, Entry, Handle, now
from stager.state.layout import PLACE, Layout
from stager.state.leases import Lease
from stager.state.statelog import StateLog
from stager.state.store import Store
from stager.wire.progress import Progress
from stager.wire.schemas import ErrorInfo, LeaseCreate, State

log = logging.getLogger("stager.engine.lifecycle")

AsUser = Callable[..., Awaitable[Any]]  # (uid, fn, *args) -> fn's JSON result
Dataset = tuple[str, "int | None"]  # an evicted dataset's key and private owner
# A name's link is the owner's convenience: making it may not hold the publish, which
# everyone sharing the entry waits on, longer than this (a link in a folder on a hung
# filesystem of the user's own).
LINK_TIMEOUT_S = 5.0

FED_A_FAN_OUT = ErrorInfo(
    type="interrupted",
    message="the daemon stopped while this staging fed a multi-node fan-out, so it is not "
    "resumed from the source on its own (other nodes may hold the data by now); ask again: "
    "stager-client stage --peers slurm sources from a node that holds it",
)
DELIVERY_LOST = ErrorInfo(
    type="interrupted",
    message="the daemon stopped while this staging adopted a delivery from another node, "
    "and a restart deletes deliveries (nobody can finish sending one to a new daemon); "
    "ask again: the request stages from its sources, or a fan-out sends it again",
)


class Trash:
    """Folders moved aside (one rename, the commit point) and deleted in the background:
    a million-file delete must never hold a request or the daemon's exit. What a deleted
    dataset's open files still hold goes on ``held`` (stager.engine.held_space)."""

    def __init__(self, trash_dir: Path, spawn: Callable[[Any, str], None]) -> None:
        self.trash_dir = trash_dir
        self._spawn = spawn
        self.halt = threading.Event()  # the daemon is stopping: deletes give up
        self.freeing_bytes = 0  # counted as free space by admission meanwhile
        self.freeing_inodes = 0  # and its inodes as free inodes
        self.held = HeldSpace(trash_dir)

    def spawn_io(self, fn: Callable[..., Any], *args: Any) -> None:
        self._spawn(run_io(fn, *args), fn.__name__)

    async def discard(
        self, path: Path, nbytes: int = 0, dataset: Dataset | None = None, inodes: int = 0
    ) -> bool:
        """Move ``path`` aside and delete it later; False if it was not there.
        ``dataset``: an evicted tree's key and owner, charged for its files still open."""
        moved = await run_io(discard, path, self.trash_dir)
        if moved is not None:
            self.delete_later(moved, nbytes, dataset, inodes)
        return moved is not None

    def delete_later(
        self, path: Path, nbytes: int = 0, dataset: Dataset | None = None, inodes: int = 0
    ) -> None:
        self.freeing_bytes += nbytes
        self.freeing_inodes += inodes
        self._spawn(self._delete(path, nbytes, dataset, inodes), f"delete-{path.name}")

    async def _delete(
        self, path: Path, nbytes: int, dataset: Dataset | None, inodes: int = 0
    ) -> None:
        # Whatever is not deleted (a stop, an error) is an orphan the next start removes.
        try:
            if dataset is not None:
                # Off the admission lock: reading every process's open files takes as
                # long as the users who open them make it.
                await run_io(self.held.watch_tree, *dataset, path)
            await run_io(delete_tree, path, self.halt)
        except OSError as exc:
            log.error("could not delete %s: %s", path, exc)
        finally:
            self.freeing_bytes -= nbytes
            self.freeing_inodes -= inodes


class Registry:
    def __init__(
        self,
        settings: Settings,
        store: Store,
        metrics: Metrics,
        trash: Trash,
        crash: CrashPoints,
        as_user: AsUser | None = None,
        kinds: Kinds | None = None,
        layout: Layout | None = None,
    ) -> None:
        self.settings = settings
        self.kinds = kinds or Kinds(settings)
        self.layout = layout or Layout.load(settings, self.kinds.mounted)
        # Acts with a user's rights: never awaited under the admission lock.
        self._as_user = as_user or _as_the_daemon
        self.metrics = metrics
        self.trash = trash
        self._store = store
        self.crash = crash
        self.entries: dict[str, Entry] = {}
        self.handles: dict[tuple[int, str], Handle] = {}  # by (owner uid, name)
        self.leases: dict[str, Lease] = {}
        self.changed = asyncio.Condition()
        self._recency_saved: dict[str, float] = {}  # key -> when touch() last wrote it
        self._unlinking: dict[str, list[asyncio.Future[None]]] = {}  # links of evicted keys
        self.events = StateLog(lambda key: [h for h in self.handles.values() if h.key == key])

    @property
    def held(self) -> HeldSpace:
        return self.trash.held

    async def sweep_held(self) -> None:
        if self.held.records:
            await run_io(self.held.sweep)

    # ---- paths ---------------------------------------------------------------

    def final(self, entry: Entry) -> Path:
        return self.layout.final(entry)

    def attempt(self, entry: Entry) -> Attempt:
        assert entry.attempt is not None
        return Attempt(self.settings.partial_dir / f"{entry.key}.{entry.attempt}")

    # ---- persistence -----------------------------------------------------------

    async def durable(self, point: Durable, write: Callable[..., Any], *args: Any) -> None:
        """Make one change durable, then let the crash tests die right after it."""
        await run_io(write, *args)
        self.crash.reached(point)

    def set_image(self, entry: Entry, image: ImageRecord | None) -> None:
        """Saved with the entry's next state change."""
        entry.image = image

    async def _save(self, entry: Entry, point: Durable) -> None:
        entry.updated_at = now()
        await self.durable(point, self._store.save_entry, entry)
        await self.notify()

    async def notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def close(self) -> None:
        # A kind's close may unmount (squashfs: fusermount3 per image): a thread's work.
        await run_io(self.kinds.close)
        await run_io(self._store.close)

    async def save_progress(self, entries: list[Entry]) -> None:
        """Not a state change: where a staging was, so a restarted daemon shows it."""
        await run_io(self._store.save_progress, entries)
        await self.notify()

    # ---- start ---------------------------------------------------------------

    async def load(self) -> list[Entry]:
        """Read the store and settle what a crash or stop left; returns entries to stage."""
        entries, handles, leases = await run_io(self._store.load)
        self.entries = {e.key: e for e in entries}
        self.handles = {h.id: h for h in handles if h.key in self.entries}
        self.leases = {x.id: x for x in leases if x.handle_id in self.handles}
        await self._move_old_copies()
        to_stage = []
        for entry in self.entries.values():
            if await self.kinds.of(entry).recover(entry, self):
                continue
            if entry.active and await self._ended_unresumable(entry):
                continue
            if entry.state == State.STAGING:
                entry.move(State.QUEUED)  # interrupted: the same attempt resumes
                await self._save(entry, Durable.QUEUED)
            if entry.state == State.QUEUED:
                self.events.resumed(entry)
                # Ops re-count the work they find already done.
                entry.progress = Progress(step_names=entry.step_names)
                to_stage.append(entry)
            elif entry.state == State.READY and not await run_io(self.final(entry).is_dir):
                entry.move(State.EVICTED)
                await self._save(entry, Durable.EVICTED)
        for kind in self.kinds.all:
            await kind.settle(list(self.entries.values()), self)
        # Space an earlier run's evictions left held (found again, never stored).
        await run_io(self.held.recover, self.owner_of)
        for orphan in await run_io(self._orphans):
            if orphan.name.startswith(DISCARDED_PREFIX):
                self.trash.delete_later(orphan)  # its open files: found by recover
            elif not any([await kind.claim(orphan, self) for kind in self.kinds.all]):
                await self.trash.discard(orphan)
        return to_stage

    def owner_of(self, key: str) -> int | None:
        """The private owner of ``key``'s entry; ``key`` may be a private copy's gate."""
        entry = self.entries.get(key) or self.entries.get(self.key_at(key))
        return private_owner(entry) if entry is not None else None

    def key_at(self, name: str) -> str:
        """The key of the entry whose top under data/ is named ``name``, else ``name``."""
        for entry in self.entries.values():
            if self.layout.top(entry).name == name:
                return entry.key
        return name

    async def _move_old_copies(self) -> None:
        """Users' own copies an earlier release published at ``data/<key>`` (which told
        anyone whose each was): moved behind their gates by their kind, and their links
        pointed there."""
        moved = []
        for entry in self.entries.values():
            final, old = self.final(entry), self.layout.old_place(entry)
            if final == old:
                continue
            try:
                if await self.kinds.of(entry).move(entry, old, self):
                    moved.append(entry)
            except OSError as exc:
                # Left where it is: an orphan now, deleted below (a ready entry without
                # its data is evicted, and staged again when asked for).
                log.error("could not move %s behind its gate: %s", old, exc)
        for entry in moved:
            log.info("moved %s behind its gate (stager.state.layout)", entry.key)
            await self.durable(Durable.TOUCHED, self._store.save_entry, entry)
            final = self.final(entry)
            await asyncio.gather(*(self._link(h, final) for h in self._handles_of(entry)))

    def _orphans(self) -> list[Path]:
        """What no entry owns: attempts of ended entries, interrupted deletions. An active
        entry's data/<key> may be its publish just before a crash: ``publish`` finds it."""
        attempts = {f"{e.key}.{e.attempt}" for e in self.entries.values() if e.active and e.attempt}
        kept = {self.layout.top(e) for e in self.entries.values() if e.live}
        found = [
            c
            for c in self.settings.partial_dir.iterdir()
            if c.name not in attempts and not self.held.is_held_image(c.name)
        ]
        # data/<key> and what a kind names after it (data/<key>.erofs: a key has no
        # dot), and private copies' gates (data/u/<G>, stager.state.layout); a mount
        # point still mounted (busy at its unmount) is left for the next start.
        data, users = self.settings.data_dir, self.layout.users_dir
        found += [
            child
            for child in data.iterdir()
            if child != users
            and data / child.name.partition(".")[0] not in kept
            and not os.path.ismount(child)
        ]
        if users.is_dir():
            found += [
                gate
                for gate in users.iterdir()
                if gate not in kept and not os.path.ismount(gate / PLACE)
            ]
        return found

    # ---- a request arrives -------------------------------------------------------

    async def queue(self, entry: Entry, ask: Ask | None = None) -> Entry:
        """A new entry, or an ended one asked for again: queued for a fresh attempt,
        with what the request asks (``ask``) in place of what an earlier one asked."""
        if ask is not None:
            entry.steps, entry.verify, entry.usage = ask.steps, ask.verify, ask.usage
            entry.origin, entry.delivery = ask.origin, ask.delivery
            entry.estimate_bytes, entry.reader = ask.estimate_bytes, ask.reader
        if entry.key in self.entries:
            entry.move(State.QUEUED)
        self.entries[entry.key] = entry
        entry.attempt = None
        entry.image = None  # an earlier publish's: the new attempt's image replaces it
        entry.last_used_at = now()
        entry.progress = Progress(step_names=entry.step_names)
        await self._save(entry, Durable.QUEUED)
        self.events.queued(entry, ask.asked_as if ask is not None else None)
        return entry

    async def touch(self, entry: Entry) -> None:
        """A use, in LRU order; stored at most every ``recency_persist_s`` per entry, so
        a burst of hits costs one write."""
        entry.last_used_at = now()
        clock = time.monotonic()
        saved = self._recency_saved.get(entry.key)
        if saved is not None and clock - saved < self.settings.recency_persist_s:
            return
        self._recency_saved[entry.key] = clock
        await self.durable(Durable.TOUCHED, self._store.save_entry, entry)

    async def name(self, handle: Handle) -> Handle:
        self.handles[handle.id] = handle
        await self.durable(Durable.NAMED, self._store.save_handle, handle)
        return handle

    async def repoint(self, handle: Handle, entry: Entry) -> None:
        """The name shows another entry now, and its leases pin that one."""
        handle.key = entry.key
        await self.durable(Durable.NAMED, self._store.save_handle, handle)
        for lease in [x for x in self.leases.values() if x.handle_id == handle.id]:
            lease.key = entry.key
            await self.durable(Durable.LEASED, self._store.save_lease, lease)
        await self.notify()

    async def note_hit(self, handle: Handle, hit: bool) -> None:
        handle.hit = hit
        await self.durable(Durable.NAMED, self._store.save_handle, handle)

    async def end_name(self, handle: Handle, ended: State) -> None:
        handle.ended = ended
        await self.durable(Durable.NAMED, self._store.save_handle, handle)
        await self.notify()

    async def forget(self, handle: Handle) -> None:
        for lease in [x for x in self.leases.values() if x.handle_id == handle.id]:
            await self.release(lease)
        del self.handles[handle.id]
        await self.durable(Durable.FORGOTTEN, self._store.delete_handle, *handle.id)

    async def lease(self, handle: Handle, request: LeaseCreate) -> Lease:
        # One lease per holder and dataset: a re-run of the same job step renews it.
        for old in [x for x in self.leases.values() if x.handle_id == handle.id]:
            if old.holder == request.holder:
                await self.release(old)
        lease = Lease.create(handle.name, handle.owner, handle.key, request)
        self.leases[lease.id] = lease
        await self.durable(Durable.LEASED, self._store.save_lease, lease)
        await self.touch(self.entries[handle.key])
        return lease

    async def release(self, lease: Lease) -> None:
        self.leases.pop(lease.id, None)
        await self.durable(Durable.RELEASED, self._store.delete_lease, lease.id)

    async def drop_dead_leases(self, owner: int | None = None) -> int:
        """Drop leases past their time or their job (``owner``: that user's alone)."""
        leases = [x for x in self.leases.values() if owner is None or x.owner == owner]
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
                await self.release(lease)
                dropped += 1
        return dropped

    # ---- an attempt stages it ------------------------------------------------------

    def begin(self, entry: Entry) -> None:
        """QUEUED -> STAGING, in the step of the worker that took it from the queue and
        found it queued: nothing else runs between that look and the move. (A request
        that found it queued in between put it in the queue again, and a second worker
        that found it queued too failed the staging that ran: STAGING -> STAGING.) A
        request or a cancel arriving from then on finds it staging; :meth:`start` next."""
        entry.cancel.clear()
        entry.move(State.STAGING)

    async def start(self, entry: Entry) -> Attempt:
        """After :meth:`begin`: an interrupted attempt resumes, else a new one starts."""
        resumed = entry.attempt is not None
        if entry.attempt is None or not await run_io(self.attempt(entry).root.is_dir):
            entry.attempt, resumed = uuid.uuid4().hex[:12], False
        await self._save(entry, Durable.STAGING)
        self.events.staging(entry, resumed)
        return self.attempt(entry)

    async def publish(self, entry: Entry, outcome: Outcome) -> None:
        """STAGING -> READY, as its kind publishes; it ends with :meth:`made_ready`."""
        await self.kinds.of(entry).publish(entry, outcome, self)

    async def made_ready(self, entry: Entry, size: int, seal: Seal | None) -> None:
        """Every name's link, then the store's "ready"."""
        final = self.final(entry)
        await asyncio.gather(*(self._link(h, final) for h in self._handles_of(entry)))
        self.crash.reached(Durable.LINKED)
        entry.size_bytes, entry.seal = size, seal
        entry.move(State.READY)
        self.metrics.staged_bytes.inc(size)
        self._count_arrival(entry)
        await self._save(entry, Durable.READY)
        self.metrics.ready_after(self.events.ready(entry))

    def _count_arrival(self, entry: Entry) -> None:
        how = (entry.origin or {}).get("how", "staged")
        self.metrics.arrivals.labels(how=how).inc()
        if how == "broadcast":
            self.metrics.broadcast_bytes.inc((entry.origin or {}).get("bytes", 0))
        else:
            # What the ops read: archive bytes for an extraction, file bytes for a copy.
            self.metrics.source_bytes.inc(entry.progress.snapshot().bytes_done)

    async def drop_delivery(self, entry: Entry, folder: Path | None) -> None:
        """The staging of ``entry`` has ended: the delivery it read (``incoming/<uid>/
        <label>/``) goes before its outcome is recorded, deleted by its owner's process
        (root never walks a user's folder); after a crash, the restart removes it."""
        entry.delivery = None
        if folder is not None:
            owner = entry.reader.uid if entry.reader is not None else None
            await remove_delivery(self._as_user, owner, folder)
            self.crash.reached(Durable.DELIVERY_REMOVED)

    async def end(self, entry: Entry, state: State, error: ErrorInfo) -> None:
        """QUEUED or STAGING -> FAILED or CANCELLED. The attempt's data goes first: a
        full disk (the commonest failure) has room again for the store's write."""
        if entry.attempt is not None:
            try:
                if await self.trash.discard(self.attempt(entry).root):
                    self.crash.reached(Durable.ATTEMPT_DISCARDED)
            except OSError as exc:
                log.error("could not remove partial data of %s: %s", entry.key, exc)
        entry.move(state, error)
        self.metrics.failures.labels(type=error.type).inc()
        await self._save(entry, Durable.ENDED)
        self.events.ended(entry)

    async def interrupt(self, entry: Entry) -> None:
        """STAGING -> QUEUED when the daemon stops, unless ``_ended_unresumable``."""
        if await self._ended_unresumable(entry):
            return
        entry.move(State.QUEUED)
        await self._save(entry, Durable.QUEUED)
        self.events.interrupted(entry)

    async def note_feeding(self, entry: Entry) -> None:
        """A fan-out sends what this staging finishes as it goes (early parts): its peers
        may hold the data before it ends, so a daemon that stops does not resume it from
        the source on its own (docs/multinode.md)."""
        if entry.active and not _feeds_a_fan_out(entry):
            entry.origin = {**(entry.origin or {}), "feeds": True}
            await self._save(entry, Durable.TOUCHED)

    async def _ended_unresumable(self, entry: Entry) -> bool:
        """Whether a staging the daemon stopped was ended here, since it cannot resume:
        it fed a fan-out (its peers may hold the data), or it adopted a delivery (which a
        restart deletes) and its steps are not all done. Ended at once, not queued to
        fail later, so a request that joins it starts afresh."""
        if _feeds_a_fan_out(entry):
            why = FED_A_FAN_OUT
        elif (entry.origin or {}).get("how") == "broadcast" and not await run_io(
            self._steps_done, entry
        ):
            why = DELIVERY_LOST
        else:
            return False
        entry.move(State.FAILED, why)
        await self._save(entry, Durable.ENDED)
        self.events.ended(entry)
        return True

    def _steps_done(self, entry: Entry) -> bool:
        return entry.attempt is not None and self.attempt(entry).steps_done() == len(entry.steps)

    async def fail_unrecorded(self, entry: Entry, error: ErrorInfo) -> None:
        """The store itself failed: waiters must not hang on the entry; a restart retries it."""
        if entry.active:
            entry.move(State.FAILED, error)
        await self.notify()

    # ---- ready data leaves ------------------------------------------------------------

    async def evict(self, entry: Entry, why: str = "evicted") -> None:
        """READY -> EVICTED: the store first (a half-gone tree is never reported ready),
        then the links, then the kind's delete (a rename; the slow delete runs later)."""
        entry.move(State.EVICTED)
        await self._save(entry, Durable.EVICTED)
        self.events.evicted(entry, why)
        final = self.final(entry)
        # In the background, as each link's owner: eviction runs under the admission
        # lock, which no user's process may hold up (DELETE then waits for them).
        unlinks = [asyncio.ensure_future(self._unlink(h, final)) for h in self._handles_of(entry)]
        if unlinks:
            self._unlinking[entry.key] = unlinks
            for task in unlinks:
                task.add_done_callback(lambda _t, key=entry.key: self._unlinked(key))
        self.crash.reached(Durable.UNLINKED)
        await self.kinds.of(entry).delete(entry, self)
        self.metrics.evictions.inc()
        self.metrics.evicted_bytes.inc(entry.size_bytes)

    # ---- links -------------------------------------------------------------------------

    def _unlinked(self, key: str) -> None:
        tasks = self._unlinking.get(key, [])
        if all(t.done() for t in tasks):
            self._unlinking.pop(key, None)

    async def links_removed(self, entry: Entry) -> None:
        """Wait (outside the lock) for the links of an evicted entry to be removed."""
        tasks = self._unlinking.get(entry.key)
        if tasks:
            await asyncio.wait(tasks, timeout=LINK_TIMEOUT_S)

    def _handles_of(self, entry: Entry) -> list[Handle]:
        return [h for h in self.handles.values() if h.key == entry.key and h.link]

    async def _link(self, handle: Handle, final: Path) -> None:
        try:
            await asyncio.wait_for(
                self._as_user(handle.owner, make_link, Path(handle.link), final), LINK_TIMEOUT_S
            )
        except (OSError, StagerError, TimeoutError) as exc:
            log.error("could not create link %s: %s", handle.link, exc)

    async def _unlink(self, handle: Handle, final: Path) -> None:
        try:
            await self._as_user(handle.owner, remove_link, Path(handle.link), final)
        except (OSError, StagerError) as exc:
            log.error("could not remove link %s: %s", handle.link, exc)

    async def link(self, link: str, owner: Any, entry: Entry) -> None:
        """A ready entry's link, made as its owner on each request, or a 400 saying why."""
        try:
            await self._as_user(owner, make_link, Path(link), self.final(entry))
        except OSError as exc:
            raise BadRequest(
                f"link {link} could not be created ({exc.strerror}); choose a --link "
                "path in a folder you can write"
            ) from exc


async def open_registry(
    settings: Settings, metrics: Metrics, ops: Any, spawn: Callable[[Any, str], None],
    as_user: AsUser,
) -> Registry:  # fmt: skip
    """The registry of a starting daemon (``ops`` types the stored steps)."""
    await run_io(ensure_dirs, settings)
    store = await run_io(Store, settings.db_path, ops)
    trash = Trash(settings.partial_dir, spawn)
    crash = CrashPoints(settings.crash_after)
    kinds = Kinds(settings)
    layout = await run_io(Layout.load, settings, kinds.mounted)
    return Registry(settings, store, metrics, trash, crash, as_user, kinds, layout)


async def _as_the_daemon(_who: Any, fn: Callable[..., Any], *args: Any) -> Any:
    return await run_io(fn, *args)


def state_counts(entries: list[Entry]) -> dict[str, int]:
    counts = {state.value: 0 for state in State}
    for entry in entries:
        counts[entry.state.value] += 1
    return counts


def _feeds_a_fan_out(entry: Entry) -> bool:
    return bool((entry.origin or {}).get("feeds"))
