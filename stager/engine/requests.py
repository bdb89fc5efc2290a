"""A request, resolved: from its body to the entry that answers it, queued, joined or hit.

One trip to the caller's process (stager.request.preflight.look) gives the sources'
fingerprint, whether every user may share them and, on a miss, their checks and size;
then, under admission's lock, a join, a hit or a staging queued, and the caller's name
and lease. Only a request that takes part in a fan-out calls the fan-out room.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from stager.core.errors import Conflict, NotPublic, StagerError
from stager.core.identity import Caller
from stager.engine.names import Names
from stager.engine.scheduler import Engine
from stager.fanout.room import COPYING
from stager.fs.credentials import Reader, reader_of
from stager.request import preflight, recipes
from stager.staging.blocking import run_io
from stager.state.dataset import Ask, Entry, Handle, private_key, public_origin, spec_key
from stager.wire.schemas import (
    Adopt,
    DatasetCreate,
    DatasetPublic,
    ExportCreate,
    ExportPublic,
    ProbeResult,
    State,
)

log = logging.getLogger("stager.engine.requests")


@dataclass(frozen=True)
class Resolved:
    expansion: recipes.Expansion
    request_key: str  # of its spec alone: decides name conflicts
    key: str  # the cache key
    shared_key: str  # the key it would have if every user shared it
    reader: Reader | None
    notice: str | None  # what it is given other than it asked (a tree for an image)
    spec: dict[str, Any]  # ``image`` as decided: asked, implied or fallen back
    estimate: int | None  # from the same trip, when it looked like a miss


class Requests:
    def __init__(self, engine: Engine, names: Names) -> None:
        self.engine, self.names = engine, names
        self.settings, self.ops, self.metrics = engine.settings, engine.ops, engine.metrics
        engine.restage = self.restage

    async def start(self) -> None:
        """Recipe files are re-read per request; checked at start to tell the admin early."""
        try:
            await run_io(recipes.recipe_files, self.settings)
        except StagerError as exc:
            log.error("%s; requests naming a recipe will fail until it is fixed", exc.message)

    async def _resolve(
        self, request: DatasetCreate, caller: Caller, naming: bool = True
    ) -> Resolved:
        """``naming``: it takes its name (a probe does not)."""
        if request.recipe:
            # Rendered here; whether its release files are there is the caller's to see.
            expansion = await run_io(recipes.expand, request, self.settings)
        else:
            expansion = recipes.Expansion(steps=request.steps)
        expansion.steps = self.ops.expand(expansion.steps)  # e.g. an extract of a URL
        kinds = self.engine.reg.kinds
        request, notice = kinds.asked(request, expansion.steps, self.ops).check(
            request, expansion.steps, self.ops
        )
        spec = request.spec()
        request_key = spec_key(spec)
        if naming:  # early, before paying for a fingerprint
            self._check_name(request.name, caller.uid, request_key)
        reader = reader_of(caller) if self.settings.multi_user else None
        recipe = (request.recipe, request.params, request.source) if request.recipe else None
        # Only a miss pays for checking the sources and estimating the size (a walk): the
        # look does it in the same trip unless an entry of this spec may answer (an
        # adoption is checked by the fan-out room, against its delivery).
        check = None
        if naming and request.adopt is None:
            known = [k for k, e in self.engine.reg.entries.items() if e.spec == spec and e.live]
            check = {"spec": spec, "known": known, "uid": caller.uid, "verify": request.verify}
        found = await self.engine.as_user(
            caller,
            preflight.look,
            self.ops.dump_steps(expansion.steps),
            self.settings,
            request.fingerprint == "deep",
            request.link if naming else None,
            recipe,
            # Whether the sources are cluster-wide matters to a vouched adoption and to
            # a peer's copy alike: both bring bytes another node read under these paths.
            (request.adopt is not None and request.adopt.vouched) or COPYING.get() is not None,
            check,
        )
        key = shared_key = spec_key({"spec": spec, "sources": str(found["fingerprint"])})
        if reader is not None:
            shared, cluster_wide = found["shareable"] is True, found["cluster_wide"] is True
            key, reader = self._scope(key, reader, shared, request.adopt, cluster_wide)
        estimate = found.get("estimate")
        return Resolved(
            expansion, request_key, key, shared_key, reader, notice, spec, estimate
        )  # fmt: skip

    def _scope(
        self, key: str, reader: Reader, shared: bool, adopt: Adopt | None, cluster_wide: bool
    ) -> tuple[str, Reader]:
        """Shared by every user when every source is readable by everyone (the staging
        checks file by file), unless a shared staging of this key failed ``not_public``;
        else the caller's own copy. A broadcast copy or a peer's copy (``COPYING``) is
        shared only when vouched for and ``cluster_wide`` (every source where each node
        holds the same files: a node-local path may hold other bytes under the same
        name, size and time)."""
        earlier = self.engine.reg.entries.get(key)
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
            if adopt is None and (cluster_wide or COPYING.get() is None):
                return key, replace(reader, public=True)
            if adopt is not None and adopt.vouched and adopt.sources is None and cluster_wide:
                return key, replace(reader, public=True, vouched=True)
        return private_key(key, reader.uid), reader

    async def probe(self, request: DatasetCreate, caller: Caller) -> ProbeResult:
        """This node's cache key for ``request`` and its copy, if any; changes nothing."""
        resolved = await self._resolve(request, caller, naming=False)
        entry = self.engine.reg.entries.get(resolved.key)
        return ProbeResult(
            key=resolved.key,
            state=entry.state.value if entry else None,
            size_bytes=entry.size_bytes if entry else 0,
            origin=public_origin(entry),
            source_files=await self.engine.fanout.source_files(resolved.expansion.steps, caller),
            image=bool(resolved.spec.get("image")),
        )

    async def submit(self, request: DatasetCreate, caller: Caller) -> tuple[DatasetPublic, bool]:
        """Create or join a staging. Returns the status and whether it is already ready."""
        engine, reg = self.engine, self.engine.reg
        resolved = await self._resolve(request, caller)
        expansion, key, reader = resolved.expansion, resolved.key, resolved.reader
        existing = reg.entries.get(key)
        if existing is not None and existing.state == State.READY:
            await self._drop_if_changed(existing)
        miss = existing is None or not existing.live
        job = request.lease.slurm_job_id if request.lease else None
        steps, origin, delivery = expansion.steps, {"how": "staged", "job": job}, None
        estimate = resolved.estimate
        # A delivery of another node's, or a prefetch's copy from one: the room's to say.
        if request.adopt is not None or COPYING.get() is not None:
            arrival = await engine.fanout.arrival(
                request, caller, expansion.steps, key, resolved.shared_key, reader, miss
            )
            steps, origin, delivery = arrival.steps, arrival.origin, arrival.delivery
            estimate = arrival.estimate
        if existing is not None and not miss:
            estimate = existing.estimate_bytes
        elif estimate is None:  # a miss the look did not foresee (a changed ready entry)
            dumped = self.ops.dump_steps(expansion.steps)
            args = (dumped, request.verify, self.settings)
            estimate = int(await engine.as_user(caller, preflight.check_steps, *args))

        # The link first, as the caller and outside the lock (a user's process may take
        # its time): a link that cannot be made is a 400 that leaves nothing behind. It
        # names data/<key>, where this key's tree is whenever it is ready.
        linked = False
        if request.link and existing is not None and existing.state == State.READY:
            await reg.link(request.link, caller, existing)
            linked = True

        # Decide under one lock: concurrent identical requests must see each other's entry.
        async with engine.admission.lock:
            self._check_name(request.name, caller.uid, resolved.request_key)  # another may have won
            engine.admission.check_prefetch(estimate)
            entry = reg.entries.get(key)
            if entry is None or entry.state in (State.FAILED, State.CANCELLED, State.EVICTED):
                engine.admission.check_queue(caller.uid)
                # Asked for again: this request's steps (an adoption's, or the source's).
                ask = Ask(
                    steps=steps,
                    verify=request.verify,
                    usage=expansion.usage,
                    origin=origin,
                    delivery=delivery,
                    estimate_bytes=estimate,
                    reader=reader,
                    asked_as=(caller.uid, request.name),
                )
                room_of = None if reader is None or reader.public else caller.uid
                entry = await engine.enqueue(entry, key, resolved.spec, ask, room_of)
                self.metrics.requests.labels(outcome="miss").inc()
            else:
                outcome = "join" if entry.active else "hit"
                if entry.state == State.QUEUED and reader is not None:
                    engine.admission.queue.put(key, caller.uid)  # it waits in their turn too
                elif entry.active:
                    engine.admission.queue.joined(key)  # a request's: no prefetch slot
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
        if request.adopt is not None:
            await engine.fanout.admitted(arrival, entry)
        view = self.names.view(handle)
        view.notice = resolved.notice
        return view, entry.state == State.READY

    async def restage(self, shared: Entry) -> None:
        """A shared staging met a source not everyone may read: each name that waits on
        it gets its owner's own copy, staged with that owner's rights."""
        engine, reg = self.engine, self.engine.reg
        async with engine.admission.lock:
            for handle in engine.wanting(shared):  # a name its owner ended wants nothing
                key = private_key(shared.key, handle.owner)
                entry = reg.entries.get(key)
                if entry is None or entry.state in (State.FAILED, State.CANCELLED, State.EVICTED):
                    reader = reader_of(Caller.of_uid(handle.owner))
                    ask = Ask.again(shared, reader, handle.id)
                    low = engine.admission.is_prefetch(handle.id)  # a prefetch's stays low
                    entry = await engine.enqueue(entry, key, shared.spec, ask, handle.owner, low)
                await reg.repoint(handle, entry)

    async def _drop_if_changed(self, entry: Entry) -> None:
        """A ready dataset changed since its publish is evicted, leased or not, and
        staged again."""
        engine, reg = self.engine, self.engine.reg
        lock = engine.admission.lock
        walker = engine.processes.run_in_walker
        changed = await reg.kinds.of(entry).changed(entry, reg, lock, walker)
        if changed is None:
            return
        async with lock:
            if entry.state != State.READY:
                return  # another request found it first
            self.metrics.requests.labels(outcome="changed").inc()
            await reg.evict(entry, f"changed since it was published ({changed}); staged again")

    def _check_name(self, name: str, owner: int, request_key: str) -> None:
        reg = self.engine.reg
        handle = reg.handles.get((owner, name))
        if handle is None or handle.ended is not None or handle.spec_key == request_key:
            return
        other = reg.entries[handle.key]
        if other.live:
            raise Conflict(
                f"dataset name {name!r} is already used by a different request "
                f"(state {other.state}); DELETE /v1/datasets/{name} first, or choose another name"
            )

    # ---- fan-out: exports (docs/multinode.md) -------------------------------------------

    async def export(self, name: str, request: ExportCreate, caller: Caller) -> ExportPublic:
        """Pack part ``request.part`` of dataset ``name`` for sbcast (docs/multinode.md)."""
        reg = self.engine.reg
        entry = reg.entries[self.names.handle(name, caller).key]
        if request.early:
            await reg.note_feeding(entry)
        staging = entry.state == State.STAGING and entry.attempt is not None
        tree = reg.attempt(entry).tree if staging else None
        ready = partial(self._ready_tree, name=name)
        whole = reg.kinds.of(entry).export
        return await self.engine.fanout.export(entry, request, caller, tree, ready, whole)

    async def _ready_tree(self, entry: Entry, name: str) -> Path:
        """The published tree of ``entry``, ready and unchanged since its publish."""
        if entry.state == State.READY:
            await self._drop_if_changed(entry)
        if entry.state != State.READY:
            raise Conflict(
                f"dataset {name!r} is {entry.state}, not ready; only a ready dataset can be sent"
            )
        return self.engine.reg.final(entry)
