"""The life of cache entries, their names and leases: every change, in one place.

    queued -> staging -> ready | failed | cancelled
    staging -> queued          (the daemon stopped mid-staging: the same attempt resumes)
    ready -> evicted
    failed | cancelled | evicted -> queued   (asked for again: a new attempt)

``Registry`` holds the entries (what is staged), handles (users' names for
entries) and leases (a job's pin on an entry), and is the only code that changes
them. Each change is made in memory, written to the store, then wakes waiters
(docs/architecture.md); each transition is one log line (stager.statelog).

An *attempt* is one try at staging an entry. Its data and its resume bookkeeping
live together in ``partial/<key>.<attempt>/`` (``tree/``: the dataset being built;
``steps-done``: how many steps completed) and go away together, so an attempt
never trusts a marker it did not write, and a crash can never pair one attempt's
marker with another's (or no) data.

Every durable step, in the order a staging goes through them, is a member of
``stager.durable.Durable`` (its own small module, because the staging process
reaches some of them too); ``tests/stager/test_crash_points.py`` kills the daemon
right after each one and checks what a restart and every follow-up request make
of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from stager.blocking import run_io
from stager.cache import private_owner
from stager.dataset import Ask, Entry, Handle, now
from stager.durable import CrashPoints, Durable
from stager.errors import BadRequest, StagerError
from stager.fs.seal import Seal, protect_top, seal_tree
from stager.held_space import HeldSpace, held_open, holder_of
from stager.held_space import Record as Held
from stager.image import published as images
from stager.image.identity import ImageChanged, ImageIdentity
from stager.imaging import ImageMade, attempt_image
from stager.layout import PLACE, Layout
from stager.leases import Lease
from stager.metrics import Metrics
from stager.progress import Progress
from stager.publish import (
    DISCARDED_PREFIX,
    Attempt,
    delete_tree,
    discard,
    make_link,
    publish,
    remove_delivery,
    remove_link,
)
from stager.schemas import ErrorInfo, LeaseCreate, State
from stager.settings import Settings
from stager.statelog import StateLog
from stager.store import Store

log = logging.getLogger("stager.lifecycle")

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
    dataset's open files still hold goes on ``held`` (stager.held_space)."""

    def __init__(self, trash_dir: Path, spawn: Callable[[Any, str], None]) -> None:
        self.trash_dir = trash_dir
        self._spawn = spawn
        self.halt = threading.Event()  # the daemon is stopping: deletes give up
        self.freeing_bytes = 0  # counted as free space by admission meanwhile
        self.freeing_inodes = 0  # and its inodes as free inodes
        self.held = HeldSpace(trash_dir)

    def spawn_io(self, fn: Callable[..., Any], *args: Any) -> None:
        """``fn(*args)`` on a thread, in the background."""
        self._spawn(run_io(fn, *args), fn.__name__)

    async def discard(
        self, path: Path, nbytes: int = 0, dataset: Dataset | None = None, inodes: int = 0
    ) -> bool:
        """Move ``path`` aside and delete it later; False if it was not there.
        ``dataset``: the key and owner of an evicted tree, whose files open now stay on
        that owner's books until they are closed."""
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
                # Off the admission lock: how long reading every process's open files
                # takes is up to the users who open them.
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
        layout: Layout | None = None,
    ) -> None:
        self.settings = settings
        # Where each entry lives under data/ (a user's own copy: behind its gate).
        self.layout = layout or Layout.load(settings)
        # Acts with a user's rights (stager.engine.Engine.as_user): their links, their
        # deliveries. Never awaited under the engine's admission lock.
        self._as_user = as_user or _as_the_daemon
        self.metrics = metrics
        self.trash = trash
        self._store = store
        self._crash = crash
        self.entries: dict[str, Entry] = {}
        self.handles: dict[tuple[int, str], Handle] = {}  # by (owner uid, name)
        self.leases: dict[str, Lease] = {}
        self.changed = asyncio.Condition()
        self._recency_saved: dict[str, float] = {}  # key -> when touch() last wrote it
        self._unlinking: dict[str, list[asyncio.Future[None]]] = {}  # links of evicted keys
        self.events = StateLog(lambda key: [h for h in self.handles.values() if h.key == key])
        # How images are mounted here: the kernel as root, FUSE as a user.
        self.mount_kind = images.mount_kind()

    @property
    def held(self) -> HeldSpace:
        """Space evicted datasets still hold (lazy unmounts, open deleted files), by owner."""
        return self.trash.held

    async def sweep_held(self) -> None:
        """The periodic sweep's look at space still held: what is free now leaves the
        books (and a held image's file goes)."""
        if self.held.records:
            await run_io(self.held.sweep)

    # ---- paths ---------------------------------------------------------------

    def final(self, entry: Entry) -> Path:
        return self.layout.final(entry)

    def attempt(self, entry: Entry) -> Attempt:
        assert entry.attempt is not None
        return Attempt(self.settings.partial_dir / f"{entry.key}.{entry.attempt}")

    def image_file(self, entry: Entry) -> Path | None:
        """A published image's file (``data/<key>.erofs``, beside its mount point), as its
        record says or, before it has one (a restart), as the folder holds it."""
        final = self.final(entry)
        if entry.image is not None:
            return images.image_file(final.parent, final.name, entry.image.format)
        return images.image_of(final.parent, final.name)

    # ---- persistence -----------------------------------------------------------

    async def _durable(self, point: Durable, write: Callable[..., Any], *args: Any) -> None:
        """Make one change durable, then let the crash tests die right after it."""
        await run_io(write, *args)
        self._crash.reached(point)

    async def _save(self, entry: Entry, point: Durable) -> None:
        entry.updated_at = now()
        await self._durable(point, self._store.save_entry, entry)
        await self.notify()

    async def notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def close(self) -> None:
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
            if entry.active and entry.attempt and await run_io(self._published, entry):
                # The daemon died between the commit point and the store's "ready".
                if entry.state == State.QUEUED:
                    entry.move(State.STAGING)
                if entry.wants_image:
                    file = self.image_file(entry)
                    assert file is not None
                    made = ImageMade(str(file), images.format_of(file))
                    await self._publish_or_fail(entry, made)
                    continue
                # Sealed again on this process alone (workers=1: no fork from the daemon).
                await self.publish(entry, await run_io(seal_tree, self.final(entry), 1))
                continue
            if entry.state == State.READY and entry.image is not None:
                await self._mount_again(entry)  # after a reboot, or a crash mid-way
                continue
            if entry.active and await self._ended_unresumable(entry):
                continue
            if entry.state == State.STAGING:
                entry.move(State.QUEUED)  # interrupted: the same attempt resumes
                await self._save(entry, Durable.QUEUED)
            if entry.state == State.QUEUED:
                self.events.resumed(entry)
                # Ops re-count the work they find already done, so start the counters afresh.
                entry.progress = Progress(step_names=entry.step_names)
                to_stage.append(entry)
            elif entry.state == State.READY and not await run_io(self.final(entry).is_dir):
                entry.move(State.EVICTED)
                await self._save(entry, Durable.EVICTED)
        await self._take_down_strays()
        # Space an earlier run's evictions left held (found again, never stored).
        await run_io(self.held.recover, self._owner_of)
        for orphan in await run_io(self._orphans):
            key = images.key_of(orphan.name)
            if orphan.name.startswith(DISCARDED_PREFIX):
                self.trash.delete_later(orphan)  # its open files: found by recover
            elif orphan.parent == self.layout.users_dir:  # a private copy's gate
                key = self._key_at(orphan.name)
                file = await run_io(images.image_of, orphan, PLACE)
                if file is not None:  # perhaps one a crash left between its lazy
                    # unmount and its keeping
                    await run_io(self._retire_image, key, self._owner_of(key), 0, file)
                await self.trash.discard(orphan)
            elif orphan.parent == self.settings.data_dir and key != orphan.name:
                if orphan.name.endswith(images.BLOB_SUFFIX):
                    # Goes with its image; alone, it is deleted.
                    image = orphan.with_name(orphan.name.removesuffix(images.BLOB_SUFFIX))
                    if not await run_io(os.path.lexists, image):
                        await run_io(images.delete_image, orphan, None)
                    continue
                # Perhaps one a crash left between its lazy unmount and its keeping.
                await run_io(self._retire_image, key, self._owner_of(key), 0, orphan)
            else:
                await self.trash.discard(orphan)
        return to_stage

    def _owner_of(self, key: str) -> int | None:
        """The private owner of ``key``'s entry; ``key`` may also be the name of a private
        copy's gate (stager.layout: an evicted tree's trash is named after it)."""
        entry = self.entries.get(key) or self.entries.get(self._key_at(key))
        return private_owner(entry) if entry is not None else None

    def _key_at(self, name: str) -> str:
        """The key of the entry whose top under data/ is named ``name`` (a private copy's
        gate); ``name`` itself if none's."""
        for entry in self.entries.values():
            if self.layout.top(entry).name == name:
                return entry.key
        return name

    async def _move_old_copies(self) -> None:
        """Users' own copies that an earlier release published at ``data/<key>``, where
        anyone who could name the key learned whose each was and how large: moved to
        their place (stager.layout), each in one rename, and their names' links pointed
        there. An image keeps its mount at the old place until ``_take_down_strays``
        (after it is mounted at the new one): a reader inside it reads on."""
        moved = []
        for entry in self.entries.values():
            final, old = self.final(entry), self.layout.old_place(entry)
            if final == old:
                continue
            try:
                if await run_io(self._move_old, entry, old, final):
                    moved.append(entry)
            except OSError as exc:
                # Left where it is: an orphan now, deleted below (a ready entry without
                # its data is evicted, and staged again when asked for).
                log.error("could not move %s behind its gate: %s", old, exc)
        for entry in moved:
            log.info("moved %s behind its gate (stager.layout)", entry.key)
            await self._durable(Durable.TOUCHED, self._store.save_entry, entry)
            final = self.final(entry)
            await asyncio.gather(*(self._link(h, final) for h in self._handles_of(entry)))

    def _move_old(self, entry: Entry, old: Path, final: Path) -> bool:
        file = images.image_of(old.parent, old.name)
        tree = file is None and old.is_dir() and not os.path.ismount(old)
        if (not tree and file is None) or os.path.lexists(final):
            return False  # nothing there, or moved already (a crash mid-way: the rest is
            # an orphan)
        self.layout.prepare(entry)
        if tree:
            publish(old, final)
        else:
            assert file is not None
            to = images.image_file(final.parent, final.name, images.format_of(file))
            images.publish_image(file, to)
            if entry.image is not None:  # renamed by root: the same file, a new ctime
                with contextlib.suppress(ImageChanged):  # then the hit evicts it
                    entry.image = images.renamed(entry.image, to)
        return True

    def _published(self, entry: Entry) -> bool:
        """Whether this entry's attempt got past its commit point (see ``publish``)."""
        attempt = self.attempt(entry)
        done = attempt.steps_done() == len(entry.steps)
        if entry.wants_image:
            return (
                done and not attempt_image(attempt).exists() and self.image_file(entry) is not None
            )
        return done and not attempt.tree.exists() and self.final(entry).is_dir()

    async def _mount_again(self, entry: Entry) -> None:
        """A ready image not mounted (a reboot), or mounted from another file: mounted
        again if its file is still the one published, else evicted (never a mount over
        a deleted or changed image)."""
        file, target = self.image_file(entry), self.final(entry)
        assert entry.image is not None and file is not None
        state = await run_io(images.check, file, target, entry.image)
        if state is None:
            return
        if state == "unmounted":
            try:
                await self._mount(entry, file)
                return
            except StagerError as exc:
                state = exc.message
        log.warning("image of %s not mounted again: %s", entry.key, state)
        await self.evict(entry, f"its image could not be mounted again ({state})")

    async def _take_down_strays(self) -> None:
        """Mounts under ``data/`` that no ready image holds (a crash between an eviction's
        unmount and its delete, a failed publish, an image deleted under its mount, a
        private image's old place in a cache an earlier release made)."""
        kept = {
            str(self.final(e)): file
            for e in self.entries.values()
            if e.state == State.READY and e.image is not None and (file := self.image_file(e))
        }
        for target in await run_io(images.stray_mounts, self.settings.data_dir, kept):
            log.warning("unmounting %s: no ready image dataset is mounted there", target)
            await run_io(images.take_down, target)

    def _orphans(self) -> list[Path]:
        """What no entry owns: attempts of ended entries, evicted trees whose deletion a
        crash or stop interrupted, deletions in progress. An active entry's data/<key>
        may be its attempt's publish just before a crash: ``publish`` finds it."""
        attempts = {f"{e.key}.{e.attempt}" for e in self.entries.values() if e.active and e.attempt}
        kept = {
            self.layout.top(e) for e in self.entries.values() if e.active or e.state == State.READY
        }
        found = [
            c
            for c in self.settings.partial_dir.iterdir()
            if c.name not in attempts and not self.held.is_held_image(c.name)
        ]
        # data/<key> and an image's data/<key>.erofs, and private copies' gates
        # (data/u/<G>, stager.layout); a mount point still mounted (busy at its unmount)
        # is left for the next start.
        users = self.layout.users_dir
        found += [
            child
            for child in self.settings.data_dir.iterdir()
            if child != users
            and child.with_name(images.key_of(child.name)) not in kept
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
        """A use: moves the entry back in LRU order. Eviction reads the order from
        memory; the store hears of it at most every ``recency_persist_s`` per entry,
        so a burst of cache hits costs one write, not one each."""
        entry.last_used_at = now()
        clock = time.monotonic()
        saved = self._recency_saved.get(entry.key)
        if saved is not None and clock - saved < self.settings.recency_persist_s:
            return
        self._recency_saved[entry.key] = clock
        await self._durable(Durable.TOUCHED, self._store.save_entry, entry)

    async def name(self, handle: Handle) -> Handle:
        self.handles[handle.id] = handle
        await self._durable(Durable.NAMED, self._store.save_handle, handle)
        return handle

    async def repoint(self, handle: Handle, entry: Entry) -> None:
        """The name shows another entry now, and its leases pin that one."""
        handle.key = entry.key
        await self._durable(Durable.NAMED, self._store.save_handle, handle)
        for lease in [x for x in self.leases.values() if x.handle_id == handle.id]:
            lease.key = entry.key
            await self._durable(Durable.LEASED, self._store.save_lease, lease)
        await self.notify()

    async def note_hit(self, handle: Handle, hit: bool) -> None:
        """Whether the latest request for this name found its data already cached."""
        handle.hit = hit
        await self._durable(Durable.NAMED, self._store.save_handle, handle)

    async def end_name(self, handle: Handle, ended: State) -> None:
        """Its owner ended the name (a cancel): it shows ``ended`` from now on."""
        handle.ended = ended
        await self._durable(Durable.NAMED, self._store.save_handle, handle)
        await self.notify()

    async def forget(self, handle: Handle) -> None:
        for lease in [x for x in self.leases.values() if x.handle_id == handle.id]:
            await self.release(lease)
        del self.handles[handle.id]
        await self._durable(Durable.FORGOTTEN, self._store.delete_handle, *handle.id)

    async def lease(self, handle: Handle, request: LeaseCreate) -> Lease:
        # One lease per holder and dataset: a re-run of the same job step renews it.
        for old in [x for x in self.leases.values() if x.handle_id == handle.id]:
            if old.holder == request.holder:
                await self.release(old)
        lease = Lease.create(handle.name, handle.owner, handle.key, request)
        self.leases[lease.id] = lease
        await self._durable(Durable.LEASED, self._store.save_lease, lease)
        await self.touch(self.entries[handle.key])
        return lease

    async def release(self, lease: Lease) -> None:
        self.leases.pop(lease.id, None)
        await self._durable(Durable.RELEASED, self._store.delete_lease, lease.id)

    # ---- an attempt stages it ------------------------------------------------------

    async def start(self, entry: Entry) -> Attempt:
        """QUEUED -> STAGING. An interrupted attempt resumes where its marker says; any
        other start is a new attempt, in a folder of its own."""
        resumed = entry.attempt is not None
        if entry.attempt is None or not await run_io(self.attempt(entry).root.is_dir):
            entry.attempt, resumed = uuid.uuid4().hex[:12], False
        entry.cancel.clear()
        entry.move(State.STAGING)
        await self._save(entry, Durable.STAGING)
        self.events.staging(entry, resumed)
        return self.attempt(entry)

    async def publish(self, entry: Entry, seal: Seal | ImageMade) -> None:
        """STAGING -> READY: what happens when a staging is published, in order.

        1. The attempt's complete tree is renamed to ``data/<key>``: the commit point;
           a tree under ``data/`` is complete by construction. (Already done if the
           daemon died right after it: then the tree is gone and ``data/<key>`` is there.)
           Its top folder then becomes read-only like the rest (stager.fs.seal).
        2. Every name's link points at it, so whoever step 3 wakes can use its link.
        3. The store says ready.
        4. The attempt's folder, now holding its marker and any input the staging set
           aside (an extracted download), is removed.
        """
        if isinstance(seal, ImageMade):
            await self._publish_image(entry, seal)
            return
        attempt, final = self.attempt(entry), self.final(entry)
        if await run_io(attempt.tree.is_dir):
            await run_io(self.layout.prepare, entry)
            await self._durable(Durable.PUBLISHED, publish, attempt.tree, final)
        # Again after a crash: it changes nothing then.
        await run_io(protect_top, final, private_owner(entry))
        await self._made_ready(entry, seal.nbytes, seal)
        await self._durable(Durable.ATTEMPT_REMOVED, delete_tree, attempt.root, threading.Event())

    async def _made_ready(self, entry: Entry, size: int, seal: Seal | None) -> None:
        """A published dataset's last steps, tree or image: every name's link, then the
        store's "ready" (steps 2 and 3 of :meth:`publish`)."""
        final = self.final(entry)
        await asyncio.gather(*(self._link(h, final) for h in self._handles_of(entry)))
        self._crash.reached(Durable.LINKED)
        entry.size_bytes, entry.seal = size, seal
        entry.move(State.READY)
        self.metrics.staged_bytes.inc(size)
        self._count_arrival(entry)
        await self._save(entry, Durable.READY)
        self.metrics.ready_after(self.events.ready(entry))

    async def _publish_image(self, entry: Entry, made: ImageMade) -> None:
        """STAGING -> READY for an image dataset, in order:

        1. The attempt's image is renamed to ``data/<key>.erofs``: the commit point (as a
           tree's rename is; already done if the daemon died right after it).
        2. It is mounted read-only at ``data/<key>`` (asked of the kernel again after a
           crash: a mount already there of this very file is kept).
        3. Every name's link, the store's "ready", the attempt's folder removed (in the
           background: it may hold the tree the image was packed from).

        A mount that fails takes the image away again and raises: the staging fails.
        """
        attempt, final = self.attempt(entry), self.final(entry)
        file = images.image_file(final.parent, final.name, made.format)
        if await run_io(os.path.exists, made.path) and Path(made.path) != file:
            await run_io(self.layout.prepare, entry)
            await self._durable(
                Durable.IMAGE_PUBLISHED, images.publish_image, Path(made.path), file
            )
        identity = await run_io(ImageIdentity.stamp, str(file), made.sha256)
        blob = await run_io(images.blob_identity, file)
        record = images.ImageRecord(
            made.format, self.mount_kind, identity, made.files, made.folders, made.data_bytes, blob
        )
        entry.image = record
        try:
            await self._mount(entry, file)
        except (OSError, StagerError):
            entry.image = None
            await run_io(images.take_down, self.final(entry))
            await run_io(images.delete_image, file, self.final(entry))
            await run_io(self.layout.release, entry)
            raise
        size = identity.size + (blob.size if blob is not None else 0)
        await self._made_ready(entry, size, None)
        if await self.trash.discard(attempt.root):
            self._crash.reached(Durable.ATTEMPT_REMOVED)

    async def _publish_or_fail(self, entry: Entry, made: ImageMade) -> None:
        """A restart's publish of an image published before the crash: a mount that
        fails now fails the entry, with the sentence why."""
        try:
            await self._publish_image(entry, made)
        except (OSError, StagerError) as exc:
            message = exc.message if isinstance(exc, StagerError) else str(exc)
            await self.end(entry, State.FAILED, ErrorInfo(type="mount_failed", message=message))

    async def _mount(self, entry: Entry, file: Path) -> None:
        """Mount ``file`` at ``data/<key>`` (durable step MOUNTED)."""
        backing = self.layout.backing(entry, self.settings.image_backing)
        target = self.final(entry)
        await self._durable(
            Durable.MOUNTED, images.mount_image, file, target, self.mount_kind, backing
        )

    async def mount_again(self, entry: Entry) -> None:
        """A hit found a ready image unmounted (by an admin, or lost): mounted again."""
        file = self.image_file(entry)
        assert file is not None
        await self._mount(entry, file)

    def _count_arrival(self, entry: Entry) -> None:
        how = (entry.origin or {}).get("how", "staged")
        self.metrics.arrivals.labels(how=how).inc()
        if how == "broadcast":
            self.metrics.broadcast_bytes.inc((entry.origin or {}).get("bytes", 0))
        else:
            # What the ops read: archive bytes for an extraction, file bytes for a copy.
            self.metrics.source_bytes.inc(entry.progress.snapshot().bytes_done)

    async def drop_delivery(self, entry: Entry, folder: Path | None) -> None:
        """The staging of ``entry`` has ended: the delivery it read is no longer its,
        and its folder (if it is still there to remove) goes."""
        entry.delivery = None
        if folder is not None:
            owner = entry.reader.uid if entry.reader is not None else None
            await self._remove_delivery(folder, owner)

    async def _remove_delivery(self, folder: Path, owner: int | None) -> None:
        """A broadcast copy (``incoming/<uid>/<label>/``) that a staging read, once it
        has ended: read once, it goes before the staging's outcome is recorded, deleted
        by its owner's process (the folder is theirs to write: root never walks it).
        After a crash before this, the restart removes it with the rest of
        ``incoming/``."""
        await remove_delivery(self._as_user, owner, folder)
        self._crash.reached(Durable.DELIVERY_REMOVED)

    async def end(self, entry: Entry, state: State, error: ErrorInfo) -> None:
        """QUEUED or STAGING -> FAILED or CANCELLED; the attempt's data goes with it.

        The data goes first: a full disk (the commonest failure) has room again for the
        store's write, and a crash in between restarts the staging in a new attempt.
        """
        if entry.attempt is not None:
            try:
                if await self.trash.discard(self.attempt(entry).root):
                    self._crash.reached(Durable.ATTEMPT_DISCARDED)
            except OSError as exc:
                log.error("could not remove partial data of %s: %s", entry.key, exc)
        entry.move(state, error)
        self.metrics.failures.labels(type=error.type).inc()
        await self._save(entry, Durable.ENDED)
        self.events.ended(entry)

    async def interrupt(self, entry: Entry) -> None:
        """STAGING -> QUEUED when the daemon stops: the attempt resumes at the next start;
        unless it fed a fan-out (``note_feeding``) or adopted a delivery: then it ends,
        left to the next request (``_ended_unresumable``)."""
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
        """Whether a staging the daemon stopped was ended here, since it cannot resume
        at the next start. Ended at once, not queued to fail later: a request that
        joined a doomed resumption would share its failure, where after the end it
        starts afresh. One that fed a fan-out is not resumed (its peers may hold the
        data by now); an adoption whose steps are not all done cannot be (a restart
        deletes deliveries), and one whose steps are done resumes to its publish."""
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
        """READY -> EVICTED. The store says so first, so a half-gone tree is never reported
        ready; links go next; then one rename takes the tree out of ``data/``, and the slow
        delete of a million files runs afterwards, in the background. ``why``: for the log."""
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
        self._crash.reached(Durable.UNLINKED)
        if entry.wants_image:
            await self._remove_image(entry)
        elif await self.trash.discard(
            self.layout.top(entry),  # a private copy's gate with it
            entry.size_bytes,
            (entry.key, private_owner(entry)),
            entry.seal.entries if entry.seal else 0,
        ):
            self._crash.reached(Durable.DATA_DISCARDED)
        self.metrics.evictions.inc()
        self.metrics.evicted_bytes.inc(entry.size_bytes)

    async def _remove_image(self, entry: Entry) -> None:
        """An evicted image: unmounted (lazily if a process without a lease still reads
        it: stager.image.published.take_down), then its file and mount point deleted.
        One file: no tree to move aside and delete in the background. A lazily unmounted
        image's file is kept instead, on its owner's books, until its readers let go
        (stager.held_space): unlinked, its blocks would stay in use, counted nowhere."""
        final, file = self.final(entry), self.image_file(entry)
        owner = private_owner(entry)
        # A shared image's held space is charged to whoever holds its mount, found by
        # the mount's file system (gone from the mount table once detached).
        device = await run_io(_device_of, final) if owner is None else None
        lazily = await run_io(images.take_down, final)
        self._crash.reached(Durable.UNMOUNTED)
        if lazily and file is not None:
            if owner is None and device is not None:
                # Whose process holds it: one sitting in it, found at once.
                owner = await run_io(holder_of, device, False)
            kept = await run_io(self._retire_image, entry.key, owner, entry.size_bytes, file)
            if kept is not None and owner is None and device is not None:
                # One holding a file of it: off the admission lock, as reading every
                # process's open files takes as long as users make it.
                self.trash.spawn_io(self.held.charge_holder, kept, device)
            file = None
        await run_io(images.delete_image, file, final)
        await run_io(self.layout.release, entry)
        self._crash.reached(Durable.IMAGE_DELETED)

    def _retire_image(self, key: str, owner: int | None, nbytes: int, file: Path) -> Held | None:
        """An unmounted image's file: kept on ``owner``'s books while anything still
        holds it open (a lazily unmounted mount; its record returned), else deleted."""
        if not held_open(file):
            images.delete_image(file, None)
            return None
        blob = images.blob_of(file)
        if not nbytes:
            nbytes = sum(p.stat().st_size for p in (file, blob) if p.exists())
        return self.held.keep_image(key, owner, nbytes, [file, blob])

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
        """A ready entry's link, on each request for it: the link (made again if it was
        removed), made as its owner (only where they may write), or a 400 saying why
        not."""
        try:
            await self._as_user(owner, make_link, Path(link), self.final(entry))
        except OSError as exc:
            raise BadRequest(
                f"link {link} could not be created ({exc.strerror}); choose a --link "
                "path in a folder you can write"
            ) from exc


async def _as_the_daemon(_who: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """A registry of a daemon that acts for nobody else (per-user mode, tests)."""
    return await run_io(fn, *args)


def _device_of(path: Path) -> int | None:
    try:
        return os.stat(path).st_dev
    except OSError:
        return None


def state_counts(entries: list[Entry]) -> dict[str, int]:
    counts = {state.value: 0 for state in State}
    for entry in entries:
        counts[entry.state.value] += 1
    return counts


def _feeds_a_fan_out(entry: Entry) -> bool:
    return bool((entry.origin or {}).get("feeds"))
