"""The node side of a prefetch: a proven order becomes an ordinary ``Requests.submit`` as
the job's user, named ``prefetch-JOB-DATASET``, so it gets the same checks, quota and
cache key as the user's own request, and the job's own request is a hit. Besides, it is
low in the fair queue, holds a lease (``prefetch-job-JOB``) until it ends, counts
against a per-user and a per-node budget, and ends once: **used**, **wasted** or
**failed** (docs/prestaging.md, "The node side").
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from stager.core import vouch
from stager.core.errors import (
    BadRequest,
    Conflict,
    Forbidden,
    NotFound,
    StagerError,
    TooManyRequests,
)
from stager.core.identity import Caller
from stager.core.metrics import Metrics
from stager.core.settings import Settings
from stager.engine.admission import PREFETCH_HOLDER, PREFETCHING
from stager.fanout.room import COPYING, PeerCopy
from stager.ops import copy_from_node as copying
from stager.prestage.prefetch import book as books
from stager.prestage.prefetch.authority import (
    ASKER,
    COPY,
    WHAT,
    PrefetchOrder,
    Seen,
    credential_of,
    job_user,
    verify,
)
from stager.prestage.prefetch.book import Book, Prefetch, prefetch_name
from stager.staging.blocking import run_io
from stager.state.dataset import State
from stager.wire.schemas import MAX_BYTES, DatasetPublic, ExportCreate, LeaseCreate

log = logging.getLogger("stager.prestage.prefetch")


# Copies of one user's prefetches packed or sent from this node at once (each a packing
# of its tree, and a place on the port): a user with many multi-node jobs gets no more.
COPIES_PER_USER = 4


def _holder(job: int) -> str:
    return f"{PREFETCH_HOLDER}{job}"


class Prefetches:
    def __init__(self, requests: Any, settings: Settings, metrics: Metrics) -> None:
        self.requests, self.names, self.engine = requests, requests.names, requests.engine
        self.settings, self.metrics = settings, metrics
        self.book, self.seen = Book(), Seen()
        self._loaded = False
        self._sweeper: asyncio.Task[None] | None = None
        # The book, the spent credentials and their file: held only for steps that do not
        # wait on a user (a user's checks run in their own process, which they may stop).
        self._lock = asyncio.Lock()
        # One order of a user's at a time (budgets and the book decided on what came
        # before), beside other users' orders: one user's slow checks hold up nobody else.
        self._user_locks: dict[int, tuple[asyncio.Lock, int]] = {}  # and how many want it
        self._sending: dict[int, int] = {}  # uid: copies being packed or sent from here
        # (job, dataset) of the book's prefetches ended for overstaying their slot
        # (_overstaying): an order for the same again is not begun anew (as a failed
        # one is not). In memory: a restart forgets it, as it forgets whose turn it was.
        self._overstayed: set[tuple[int, str]] = set()
        # Told of each prefetch's request (placement names its node feature).
        self.requested_as: Callable[[Any, Caller, DatasetPublic], None] = lambda *_: None

    async def start(self) -> None:
        """Load what the last run kept and expire unused prefetches every minute (node
        service only)."""
        if not self.settings.multi_user:
            return
        await self._load()
        self.names.prestaged = self.job_for
        # Often enough to end a prefetch overstaying its slot (prefetch_slot_s) soon after.
        period = min(60.0, max(0.25, self.settings.prefetch_slot_s / 4))
        self._sweeper = asyncio.ensure_future(self._sweep_every(period))

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper

    async def _sweep_every(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await self.sweep()
            except (StagerError, OSError):
                log.exception("could not expire unused prefetches")

    async def _load(self) -> None:
        if not self._loaded:
            self.book, seen = await run_io(books.load, self.settings.prefetch_path)
            self.seen = Seen(seen)
            self._loaded = True

    async def _save(self) -> None:
        # A copy taken on the loop: other users' orders change the book meanwhile.
        book, seen = Book(list(self.book.prefetches.values())), dict(self.seen.entries)
        await run_io(books.save, self.settings.prefetch_path, book, seen)

    async def order(
        self, header: str | None, body: bytes, copy_header: str | None = None
    ) -> list[dict]:
        """Carry out a proven order; what each of its prefetches is now. A copy comes
        with the planner's second credential (``copy_header``), for its source node."""
        if not self.settings.multi_user:
            raise Forbidden("only the node service (stager serve --multi-user) takes prefetches")
        order, user = await self._proven(body, (header, WHAT))
        async with self._user_lock(order.uid):
            async with self._lock:
                await self._save()  # the credential is spent before anything is done
                await self._expire()
            if order.action == "cancel":
                done = await self._cancel(order, user)
            elif order.action == "copy":
                peer = PeerCopy(
                    node=str(order.source),
                    address=str(order.source_address),
                    authorization=f"Munge {credential_of(copy_header)}",
                    order=body,
                    job=order.job,
                )
                token = COPYING.set(peer)
                try:
                    done = [await self._stage(order, user)]
                finally:
                    COPYING.reset(token)
            else:
                done = [await self._stage(order, user)]
            async with self._lock:
                await self._save()
        return [_public(p, self._ready(p)) for p in done]

    @contextlib.asynccontextmanager
    async def _user_lock(self, uid: int) -> AsyncIterator[None]:
        lock, users = self._user_locks.get(uid, (asyncio.Lock(), 0))
        self._user_locks[uid] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._user_locks[uid]
            if users == 1:
                del self._user_locks[uid]  # nobody holds or awaits it
            else:
                self._user_locks[uid] = (lock, users - 1)

    async def _proven(
        self, body: bytes, *credentials: tuple[str | None, str]
    ) -> tuple[PrefetchOrder, Caller]:
        """The order ``body`` holds once each (header, purpose) credential proves it, and
        its job's user; the caller saves the spent credentials before it acts."""
        async with self._lock:
            await self._load()
        # Outside the lock: a flood of bad credentials (one unmunge each) must not hold
        # up the planner's orders. Claiming a credential is one step on the event loop.
        try:
            for header, what in credentials:
                order = await verify(header, body, self.settings, self.seen, what)
            user = await run_io(job_user, order)
        except StagerError:
            self.metrics.prefetches.labels(outcome="refused").inc()
            raise
        return order, user

    def _ready(self, prefetch: Prefetch) -> bool:
        """Whether its data is ready here: the planner sends a copy of it only then."""
        entry = self._entry(prefetch) if prefetch.state == "active" else None
        return entry is not None and entry.state == State.READY

    async def _stage(self, order: PrefetchOrder, user: Caller) -> Prefetch:
        engine = self.engine
        body = dict(order.request or {})
        if not isinstance(body.get("name"), str):
            raise BadRequest("a prefetch's request names its dataset ('name'), as stage does")
        dataset = body["name"]
        await self._drop_others(order)
        known = self.book.prefetches.get((order.job, dataset))
        source = order.source or ""
        if known is not None and known.state == "failed" and known.uid == order.uid:
            if known.source == source:
                # Sent again while its staging failed (the planner asks a copy's source
                # each interval until it is ready): not staged again and again.
                return known
        if (
            known is not None
            and (order.job, dataset) in self._overstayed
            and known.uid == order.uid
            and known.source == source
        ):
            # Ended past its slot while another user's waited, and sent again as the
            # planner asks a copy's source each interval: begun anew it would read the
            # storage a slot long and be ended again at the next wait, again and again.
            # Its job stages at its start (its copies find nothing ready here).
            return known
        if known is not None and known.state == "active" and known.uid == order.uid:
            entry = self._entry(known)
            if known.source == source or (entry is not None and entry.state == State.READY):
                known.source = source  # the data is here already, however it came
                return known  # sent again (the planner restarted, slurmctld re-ran a hook)
            # Re-targeted: the job's first planned node moved, so this copy's source (or
            # this node's role) did; what arrives from the old source may never come.
            await self._drop(known, user, "wasted")
        name = prefetch_name(order.job, dataset)
        # Neither a link nor a lease of the planner's, nor an adoption: a prefetch is the
        # declaration's data only, read from its source by the job's user. Its own lease
        # comes with its name, in the same step (how a requeue knows it is a prefetch's).
        lease = LeaseCreate(holder=_holder(order.job), ttl_s=self.settings.prefetch_expire_s)
        body.update(name=name, link=None, lease=lease.model_dump(), adopt=None)
        try:
            request = engine.ops.request_model().model_validate(body)
        except ValueError as exc:
            raise BadRequest(f"the prefetch's request is not a stage request: {exc}") from exc
        started = time.time()

        reservation = object()

        def budget(estimate: int) -> None:  # admission's, before anything is queued
            try:
                self.book.check_budget(order.uid, estimate, self.settings)
            except StagerError:
                self.metrics.prefetches.labels(outcome="refused").inc()
                raise
            # Held until the prefetch is in the book: other users' orders go on meanwhile.
            self.book.reserved[reservation] = (order.uid, estimate)

        token = PREFETCHING.set(budget)
        try:
            view, ready = await self.requests.submit(request, user)
        finally:
            PREFETCHING.reset(token)
            self.book.reserved.pop(reservation, None)
        self.requested_as(request, user, view)
        entry = engine.registry.entries.get(view.key)
        size = view.size_bytes if ready else (entry.estimate_bytes if entry else 0)
        prefetch = Prefetch(
            job=order.job,
            uid=order.uid,
            gid=order.gid,
            dataset=dataset,
            name=name,
            key=view.key,
            bytes=size,
            started_at=started,
            source=source,
        )
        displaced = self.book.prefetches.get((order.job, dataset))
        self.book.prefetches[(order.job, dataset)] = prefetch
        self._overstayed.discard((order.job, dataset))
        self.metrics.prefetches.labels(outcome="started").inc()
        self.metrics.prefetch_bytes.labels(outcome="started").inc(size)
        log.info("prefetch for job %s: %s as uid %s (%s)", order.job, dataset, order.uid, view.key)
        if displaced is not None and displaced.uid != order.uid:
            # Another user's order for the job id, booked while this one's checks ran
            # (orders of different users go on side by side): it ends here, never left
            # holding its name, lease and data outside the book.
            owner = Caller.of_uid(displaced.uid, displaced.gid)
            await self._drop(displaced, owner, "wasted")
        return prefetch

    async def _cancel(self, order: PrefetchOrder, user: Caller) -> list[Prefetch]:
        await self._drop_others(order)
        found = [p for p in self.book.of_job(order.job) if p.state == "active"]
        for prefetch in found:
            await self._drop(prefetch, user, "wasted")
        return found

    async def _drop_others(self, order: PrefetchOrder) -> None:
        """End the job's prefetches here of another user than the order's: Slurm gave
        the job id to another user (its ids wrapped past MaxJobId, or its state was
        lost), so the first user's job is gone, and so is what was fetched for it."""
        for prefetch in self.book.of_job(order.job):
            if prefetch.state == "active" and prefetch.uid != order.uid:
                await self._drop(prefetch, Caller.of_uid(prefetch.uid, prefetch.gid), "wasted")

    def _entry(self, prefetch: Prefetch) -> Any:
        """The entry its name shows now (a staging moved to its user's own copy), if any."""
        reg = self.engine.registry
        handle = reg.handles.get((prefetch.uid, prefetch.name))
        if handle is not None and handle.ended is None:
            prefetch.key = handle.key
        return reg.entries.get(prefetch.key)

    async def _drop(self, prefetch: Prefetch, user: Caller, outcome: str) -> None:
        """End ``prefetch``: its lease and name go; its data too, unless another name (its
        user's own request) holds it. Once: the sweep and its user's order may both try."""
        if prefetch.state != "active":
            return
        entry = self._entry(prefetch)
        if entry is not None and entry.state in (State.READY, State.EVICTED):
            prefetch.bytes = entry.size_bytes  # (evicted: its user deleted it unused)
        elif entry is not None and entry.active:
            prefetch.bytes = entry.progress.snapshot().bytes_done
        else:
            prefetch.bytes = 0  # failed or gone: nothing of it is on the disk
        prefetch.state = outcome
        self.metrics.prefetches.labels(outcome=outcome).inc()
        if outcome != "failed":
            self.metrics.prefetch_bytes.labels(outcome=outcome).inc(prefetch.bytes)
        with contextlib.suppress(NotFound):  # its user cancelled the name already
            await self.names.release(prefetch.name, user, holder=_holder(prefetch.job))
            await self.names.delete(prefetch.name, user)  # the data, unless another name has it
            await self.names.delete(prefetch.name, user)  # the ended name: forgotten

    async def _expire(self) -> bool:
        """End failed stagings, names their user deleted, prefetches unused past
        ``prefetch_expire_s`` (wasted), and those holding a prefetch slot past
        ``prefetch_slot_s`` while another user's prefetch waits (:meth:`_overstaying`).
        Whether the book changed."""
        horizon = time.time() - self.settings.prefetch_expire_s
        reg = self.engine.registry
        ended = False
        overstaying = self._overstaying()
        # Before their slots are freed: the next to run is then another user's.
        for uid in sorted({p.uid for p in self.book.active() if (p.job, p.dataset) in overstaying}):
            await self._demote(uid)
        for prefetch in self.book.active():
            entry = self._entry(prefetch)
            handle = reg.handles.get((prefetch.uid, prefetch.name))
            if entry is not None and entry.state == State.FAILED:
                outcome = "failed"
            elif (
                handle is None
                or handle.ended is not None
                or prefetch.started_at < horizon
                or (entry is not None and entry.state == State.EVICTED)  # a request's room
                or (prefetch.job, prefetch.dataset) in overstaying
            ):
                outcome = "wasted"
            else:
                continue
            if (waiter := overstaying.get((prefetch.job, prefetch.dataset))) is not None:
                log.warning(
                    "prefetch for job %s (%s, uid %s) ended: it held a prefetch slot over "
                    "%g s (STAGER_PREFETCH_SLOT_S) while uid %s's prefetch waited; the job "
                    "stages at its start",
                    prefetch.job, prefetch.dataset, prefetch.uid,
                    self.settings.prefetch_slot_s, waiter,
                )  # fmt: skip
            await self._drop(prefetch, Caller.of_uid(prefetch.uid, prefetch.gid), outcome)
            if waiter is not None:
                self._overstayed.add((prefetch.job, prefetch.dataset))
            ended = True
        before = len(self.book.prefetches)
        self.book.forget_before(horizon)
        self._overstayed.intersection_update(self.book.prefetches)  # (as long as its record)
        return ended or len(self.book.prefetches) != before

    def _overstaying(self) -> dict[tuple[int, str], int]:
        """Prefetches staging for over ``prefetch_slot_s`` while another user's prefetch
        waits here for a slot, by (job, dataset), with the uid whose wait each ends:
        longest first, at most one per waiting user (each ended frees one slot).

        A slot is a time slice, as a batch scheduler's preemption after an exempt time
        (Slurm's PreemptExemptTime): a download trickling for hours, or a huge dataset,
        cannot keep every other user's prefetch on this node waiting. The one ended is
        not requeued behind them: past the slot (the planner's horizon) it would not be
        ready by its job's start anyway, and the job stages it then, at a request's
        priority. Only stagings no user request joined (prefetches' alone) count."""
        states = [(p, self._entry(p)) for p in self.book.active()]
        limit = time.time() - self.settings.prefetch_slot_s
        running = sorted(
            # The staging's start: its last state change (QUEUED -> STAGING).
            ((e.updated_at.timestamp(), p.job, p.dataset, p.uid, e.key) for p, e in states
             if e is not None and e.state == State.STAGING and e.updated_at.timestamp() < limit),
        )  # fmt: skip
        if not running:  # the usual case, at each order and sweep: nothing more to look at
            return {}
        admission = self.engine.admission
        queued = {
            p.uid
            for p, e in states
            if e is not None and e.state == State.QUEUED and admission.prefetch_only(e.key)
        }
        ended: dict[tuple[int, str], int] = {}
        for _, job, dataset, uid, key in running:
            others = sorted(queued - {uid} - set(ended.values()))
            if others and admission.prefetch_only(key):
                ended[job, dataset] = others[0]
        return ended

    async def _demote(self, uid: int) -> None:
        """``uid``'s queued prefetches go behind every other user's in the fair queue
        (withdrawn and put back, so that ``uid`` joins the turn last): the next slot goes
        to a user who waited, not to the next of the one whose prefetch overstayed."""
        admission = self.engine.admission
        async with admission.lock:  # as a request's queueing holds it
            keys = [
                e.key
                for p in self.book.active()
                if p.uid == uid
                and (e := self._entry(p)) is not None
                and e.state == State.QUEUED
                and admission.prefetch_only(e.key)
            ]
            for key in keys:
                admission.queue.discard(key, uid)
            for key in keys:
                admission.queue.put(key, uid, low=True)

    async def sweep(self) -> None:
        async with self._lock:
            await self._load()
            if self.book.active() and await self._expire():
                await self._save()

    async def requested(self, caller: Caller, view: DatasetPublic) -> None:
        """A user's own request was answered with ``view``: the prefetches of that user
        for its data are used. Their staging time is hidden when the data was ready."""
        if not self._loaded or not self.book.waiting_for(caller.uid, view.key):
            return
        async with self._user_lock(caller.uid), self._lock:
            for prefetch in self.book.waiting_for(caller.uid, view.key):
                if prefetch.name == view.name or prefetch.state != "active":
                    # Ends once: this loop waits on each release, and an order of
                    # another user's for the job id (reused) may end one meanwhile.
                    continue
                prefetch.state = "used"
                self.metrics.prefetches.labels(outcome="used").inc()
                # Joined while still staging: its estimate, as it started.
                used = view.size_bytes if view.state == State.READY else prefetch.bytes
                self.metrics.prefetch_bytes.labels(outcome="used").inc(used)
                if view.state == State.READY:
                    hidden = view.updated_at.timestamp() - prefetch.started_at
                    self.metrics.prefetch_hidden_seconds.inc(max(0.0, hidden))
                with contextlib.suppress(NotFound):
                    await self.names.release(prefetch.name, caller, holder=_holder(prefetch.job))
                    await self.names.delete(prefetch.name, caller)
            await self._save()
        view.prestaged_for_job = self.book.job_for(caller.uid, view.key)

    async def copy_out(self, header: str | None, body: bytes, asker: str | None) -> Outgoing:
        """Another planned node's copy of this node's prefetch (docs/prestaging.md, "4-node
        job"): the asking service's credential (``asker``) and then the planner's copy
        credential prove the order names this node as its source. Only the ready tree of
        this node's prefetch for that job, user and dataset is sent, packed as the fan-out
        packs it, with this service's credential for its manifest; one not ready is a 409
        at once, and a user has at most :data:`COPIES_PER_USER` copies under way."""
        if not self.settings.multi_user:
            raise Forbidden("only the node service (stager serve --multi-user) sends copies")
        order, user = await self._proven(body, (asker, ASKER), (header, COPY))
        async with self._lock:
            await self._save()  # the credential is spent before anything is sent
        dataset = (order.request or {}).get("name")
        found = isinstance(dataset, str)
        prefetch = self.book.prefetches.get((order.job, dataset)) if found else None
        if prefetch is None or prefetch.state != "active":
            raise NotFound(
                f"no prefetch of job {order.job}'s {dataset!r} waits here; node "
                f"{order.node} stages it at the job's start"
            )
        if prefetch.uid != order.uid:
            raise Forbidden(f"job {order.job}'s prefetch here is another user's")
        # Not waited for: the planner sends a copy once this node said its prefetch is
        # ready, so one not ready is answered at once, holding no place here and no
        # prefetch slot at the asking node.
        entry = self._entry(prefetch)
        if entry is None or entry.state != State.READY:
            state = entry.state.value if entry is not None else "gone"
            raise Conflict(
                f"job {order.job}'s {dataset!r} is {state} here, not ready yet; node "
                f"{order.node} stages it at the job's start"
            )
        if self._sending.get(order.uid, 0) >= COPIES_PER_USER:
            raise TooManyRequests(
                f"{COPIES_PER_USER} copies of uid {order.uid}'s prefetches are being sent "
                f"from here already; node {order.node} stages it at the job's start"
            )
        self._sending[order.uid] = self._sending.get(order.uid, 0) + 1
        label = f"copy-{order.job}-{hashlib.sha256(body).hexdigest()[:16]}"

        async def done() -> None:
            self._sending[order.uid] -= 1
            if not self._sending[order.uid]:
                del self._sending[order.uid]
            with contextlib.suppress(StagerError):
                await self.engine.fanout.drop_export(label, user)

        try:
            export = ExportCreate(label=label, part_bytes=MAX_BYTES, tree=True)
            sent = await self.requests.export(prefetch.name, export, user)
            if sent.path is None or sent.manifest is None or sent.parts != 1:
                raise Conflict(f"job {order.job}'s {dataset!r} is not one tree here to send")
            credential = await run_io(
                vouch.vouch, sent.key, sent.manifest_sha256, self.settings.munge_socket
            )
            if credential is None:
                raise Conflict("munged made no credential for the copy's manifest here")
            sizes = await run_io(lambda: [os.stat(f).st_size for f in (sent.path, sent.manifest)])
        except BaseException:
            await done()
            raise
        headers = {
            copying.KEY: sent.key,
            copying.TAR_BYTES: str(sizes[0]),
            copying.MANIFEST_BYTES: str(sizes[1]),
            copying.MANIFEST_SHA256: str(sent.manifest_sha256),
            copying.MANIFEST_CREDENTIAL: credential,
        }
        log.info("copy of job %s's %s to %s (%s)", order.job, dataset, order.node, sent.key)
        return Outgoing(headers, [sent.path, sent.manifest], done)

    def job_for(self, uid: int, key: str) -> int | None:
        """For a dataset's status: the job its data was pre-staged for here."""
        return self.book.job_for(uid, key) if self._loaded else None


@dataclass
class Outgoing:
    """A copy for another planned node: the answer's headers, the files sent one after
    the other (the tar, then the manifest), and what to do once they went (or not)."""

    headers: dict[str, str]
    files: list[str]
    done: Callable[[], Awaitable[None]]


def _public(prefetch: Prefetch, ready: bool) -> dict:
    return {
        "ready": ready,
        "job": prefetch.job,
        "dataset": prefetch.dataset,
        "name": prefetch.name,
        "key": prefetch.key,
        "uid": prefetch.uid,
        "state": prefetch.state,
        "bytes": prefetch.bytes,
    }
