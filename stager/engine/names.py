"""Users' names of datasets: their status, waits and events, cancel and evict, their
leases, and gc. A decision on an entry's fate is taken under admission's lock.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from stager.core.errors import Conflict, Forbidden, NotFound
from stager.core.identity import Caller
from stager.engine.scheduler import Engine
from stager.state import cache
from stager.state.dataset import CANCELLED_BY_REQUEST, Entry, Handle, public_view
from stager.state.leases import Lease
from stager.wire.schemas import DatasetPublic, GcRequest, GcResult, LeaseCreate, LeasePublic, State
from stager.wire.suggest import did_you_mean


class Names:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.settings, self.metrics = engine.settings, engine.metrics
        # The job a user's data was pre-staged for (the prefetch service sets it).
        self.prestaged: Callable[[int, str], int | None] = lambda uid, key: None

    def get(self, name: str, caller: Caller, owner: int | None = None) -> DatasetPublic:
        return self.view(self.handle(name, caller, owner))

    def list(self, caller: Caller) -> list[DatasetPublic]:
        """The caller's own names; root's list holds every user's."""
        handles = sorted(
            (
                h
                for h in self.engine.reg.handles.values()
                if caller.is_root or h.owner == caller.uid
            ),
            key=lambda h: (h.name, h.owner),
        )
        return [self.view(h) for h in handles]

    async def wait(
        self, name: str, timeout: float, caller: Caller, owner: int | None = None
    ) -> DatasetPublic:
        """Long-poll: return once the dataset is terminal or ``timeout`` has passed."""
        handle = self.handle(name, caller, owner)
        with self.metrics.waiting.track_inprogress():
            await self.engine.until(
                lambda: handle.ended is None and self.engine.reg.entries[handle.key].active, timeout
            )
        return self.view(handle)

    async def watch(
        self, name: str, caller: Caller, owner: int | None = None, interval: float = 0.5
    ) -> AsyncIterator[DatasetPublic]:
        """Statuses for server-sent events: on every change, at most every ``interval``."""
        handle = self.handle(name, caller, owner)
        last = None
        while True:
            view = self.view(handle)
            snapshot = (view.state, view.progress)
            if snapshot != last:
                last = snapshot
                yield view
            if view.state.terminal or self.engine.stopping:
                return
            async with self.engine.reg.changed:
                try:
                    await asyncio.wait_for(self.engine.reg.changed.wait(), interval)
                except TimeoutError:
                    pass

    async def delete(self, name: str, caller: Caller, owner: int | None = None) -> DatasetPublic:
        """Cancel if staging, evict if ready, forget the name if already finished; 409
        while leased. Data stays while any other live name holds it. A name cancelled
        alone stays, ended: another name staging the same data never revives it."""
        reg = self.engine.reg
        dropped: Entry | None = None
        async with self.engine.admission.lock:
            handle = self.handle(name, caller, owner)
            entry = reg.entries[handle.key]
            live = handle.ended is None and entry.live
            holders = sorted({x.holder for x in reg.leases.values() if x.handle_id == handle.id})
            if holders and live:
                raise Conflict(
                    f"dataset {name!r} is leased by {', '.join(holders)}, so it stays (the name "
                    f"and its data); release it first (stager-client release {name}) or wait "
                    "for those jobs to end"
                )
            wanting = [h for h in self.engine.wanting(entry) if h.id != handle.id]
            others = len(wanting)
            if others or not live:
                view = self.view(handle)
                await reg.forget(handle)
                admission = self.engine.admission
                if live and not any(h.owner == handle.owner for h in wanting):
                    admission.queue.discard(entry.key, handle.owner)  # not in their turn
                if entry.active and admission.prefetch_only(entry.key):
                    admission.queue.left(entry.key)
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
                # Out of the queue first: a worker free while the end deletes its partial
                # data took it, and the end then cancelled the staging it ran.
                self.engine.admission.queue.discard(entry.key)
                await reg.end(entry, State.CANCELLED, CANCELLED_BY_REQUEST)
                dropped = entry
                outcome = f"cancelled {name!r} before it started; nothing was staged"
            elif entry.state == State.STAGING:
                entry.cancel.set()
                outcome = f"cancelled the staging of {name!r}; its partial data is deleted"
            else:
                await reg.evict(entry, "on request (stager-client cancel)")
                outcome = f"evicted {name!r}: its data is deleted from this node's cache"
        if dropped is not None:
            await self.engine.drop_claimed(dropped)  # its owner deletes it: outside the lock
        await reg.links_removed(entry)
        if entry.state == State.STAGING:  # outside the lock: its process may take a moment
            grace = self.settings.cancel_grace_s + 2.0
            timeout = max(grace, self.settings.shutdown_timeout_s)
            await self.engine.until(lambda: entry.state == State.STAGING, timeout)
        view = self.view(handle)
        view.outcome = outcome
        return view

    # ---- leases ----------------------------------------------------------------------

    async def lease(
        self, name: str, request: LeaseCreate, caller: Caller, owner: int | None = None
    ) -> LeasePublic:
        handle = self.handle(name, caller, owner)
        async with self.engine.admission.lock:
            # Under the lock: a cancel that lands between a look and the lease would
            # leave a lease pinning a cancelled name's entry.
            if handle.ended is not None:
                raise Conflict(
                    f"dataset {name!r} was {handle.ended.value} by its owner; stage it again "
                    "before leasing it"
                )
            lease = await self.engine.reg.lease(handle, request)
        return lease.public()

    async def release(
        self,
        name: str,
        caller: Caller,
        lease_id: str | None = None,
        holder: str | None = None,
        owner: int | None = None,
    ) -> list[LeasePublic]:
        """One lease by id, or every lease of ``holder`` (or all) on this dataset."""
        handle = self.handle(name, caller, owner)
        chosen = [
            lease
            for lease in self.engine.reg.leases.values()
            if lease.handle_id == handle.id
            and (lease_id is None or lease.id == lease_id)
            and (holder is None or lease.holder == holder)
        ]
        if lease_id is not None and not chosen:
            raise NotFound(f"dataset {name!r} has no lease {lease_id!r}")
        return await self._release(chosen)

    async def release_holder(self, holder: str, caller: Caller) -> list[LeasePublic]:
        """Every lease of ``holder`` on the caller's datasets (root: anyone's)."""
        return await self._release(
            [
                x
                for x in self.engine.reg.leases.values()
                if x.holder == holder and (caller.is_root or x.owner == caller.uid)
            ]
        )

    async def _release(self, leases: list[Lease]) -> list[LeasePublic]:
        for lease in leases:
            await self.engine.reg.release(lease)
        return [lease.public() for lease in leases]

    # ---- sweeping --------------------------------------------------------------------

    async def gc(self, request: GcRequest, caller: Caller) -> GcResult:
        """Drop dead leases; evict unnamed (superseded) entries, or every unleased one
        (node service: root only). In the node service a user's gc touches only their
        own leases and private copies; shared entries are root's to collect."""
        if request.all and self.settings.multi_user and not caller.is_root:
            raise Forbidden(
                "only root may evict every unleased dataset of the node service; "
                "DELETE your own datasets instead"
            )
        mine = self.settings.multi_user and not caller.is_root
        dropped = await self.engine.reg.drop_dead_leases(caller.uid if mine else None)
        async with self.engine.admission.lock:
            # Only live names keep an entry: one that only ended names show is superseded.
            named = {h.key for h in self.engine.reg.handles.values() if h.ended is None}
            victims = [
                e
                for e in cache.evictable(self.engine.entries(), self.engine.admission.protected())
                if (request.all or e.key not in named)
                and (not mine or cache.private_owner(e) == caller.uid)
            ]
            why = "by gc --all" if request.all else "by gc: no name refers to it any more"
            for victim in victims:
                await self.engine.reg.evict(victim, why)
        return GcResult(
            evicted=[v.key for v in victims],
            freed_bytes=sum(v.size_bytes for v in victims),
            leases_dropped=dropped,
        )

    def handle(self, name: str, caller: Caller, owner: int | None = None) -> Handle:
        """The caller's handle ``name``; root may name another user's with ``owner``."""
        if owner is not None and owner != caller.uid and not caller.is_root:
            raise Forbidden(
                f"dataset names of uid {owner} are theirs; only root may act on another "
                "user's datasets (leave out owner)"
            )
        handle = self.engine.reg.handles.get((caller.uid if owner is None else owner, name))
        if handle is None:
            whose = caller.uid if owner is None else owner
            known = [n for (uid, n) in self.engine.reg.handles if uid == whose]
            raise NotFound(
                f"no dataset named {name!r}; {did_you_mean(name, known)}"
                "GET /v1/datasets lists the known ones"
            )
        return handle

    def view(self, handle: Handle) -> DatasetPublic:
        reg = self.engine.reg
        leases = [x.public() for x in reg.leases.values() if x.handle_id == handle.id]
        entry = reg.entries[handle.key]
        view = public_view(handle, entry, reg.final(entry), leases)
        view.prestaged_for_job = self.prestaged(handle.owner, handle.key)
        return view
