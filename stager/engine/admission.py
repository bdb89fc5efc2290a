"""Admission: who gets room on the cache disk and a staging slot, decided in one place,
under one lock (:attr:`Admission.lock`), for the engine and the fan-out room alike.

- **Room** (:meth:`Admission.make_room`): evicting ready entries nobody holds, least
  recently used first, the user's own first for their quota, then any for the cache's
  capacity and the disk's floor; or refused with the sizes. Room promised to
  transfers and not written yet is not free; neither is space evicted datasets still
  hold (stager.engine.held_space). Both count against their user's quota.
- **Protected keys** (:meth:`Admission.protected`): leased, staging or being packed.
- **Slots** (:class:`FairQueue`): round-robin between users, per-user caps on running
  and queued stagings (429 past them; prefetches queue apart from requests, so the
  planner's orders never fill a user's queue); a prefetch's staging is low.
- **Prefetch budgets** (:meth:`Admission.check_prefetch`): refused before anything is
  queued, named or written.

docs/multiuser.md, "Fair use of the node", holds the rules and their reasons.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol

from stager.core.errors import TooManyRequests
from stager.core.settings import Settings
from stager.request import preflight
from stager.staging.blocking import run_io
from stager.state import cache
from stager.state.dataset import Entry, Handle
from stager.state.leases import Lease

log = logging.getLogger("stager.engine.admission")

# Set by the prefetch service around its Requests.submit to the prefetch's budget check
# (raises past it): the stagings it queues are low. A context variable, not a parameter:
# only admission reads it, and the request path stays the one a user's request takes.
PREFETCHING: ContextVar[Callable[[int], None] | None] = ContextVar(
    "stager_prefetching", default=None
)
# The lease a prefetch holds until its job uses it: how a requeued staging is known to be
# a prefetch's (a user who names their own lease so makes only their own staging low).
PREFETCH_HOLDER = "prefetch-job-"


@dataclass(frozen=True)
class Held:
    """What the fan-out room holds: room promised and not written, keys being packed."""

    unwritten_bytes: int
    exporting: set[str]
    reserved_by: dict[int, int]  # the bytes each user's transfers hold, for their quota


class _Trash(Protocol):
    freeing_bytes: int
    freeing_inodes: int


class _HeldSpace(Protocol):
    def bytes_of(self, owner: int) -> int: ...

    @property
    def total_bytes(self) -> int: ...


class Books(Protocol):
    """What admission reads and does of the registry."""

    entries: dict[str, Entry]
    handles: dict[tuple[int, str], Handle]
    leases: dict[str, Lease]
    trash: _Trash

    @property
    def held(self) -> _HeldSpace: ...

    async def evict(self, entry: Entry, why: str = ...) -> None: ...


class FairQueue:
    """Stagings waiting for a slot, per user, served round-robin between users.

    A staging waits in the turn of every user who asked for it (the first, and each
    who joined it while queued), runs in the first of their turns to come while that
    user is under ``running_cap``, and is charged to that user: a join never runs later
    than the joiner's own staging would have. ``low_cap``: the most low stagings
    (prefetches) running at once (``running``: whether a key still runs). A request
    asking for a low staging makes it no longer low, queued (:meth:`put`) or running
    (:meth:`joined`): then it takes no low slot, and its place goes to the next low one;
    one the last request left is low again (:meth:`left`)."""

    def __init__(
        self,
        running_cap: int | None = None,
        low_cap: int | None = None,
        running: Callable[[str], bool] = lambda key: True,
    ) -> None:
        self.running_cap = running_cap
        self.low_cap, self._still_running = low_cap, running
        # Low keys handed out, until their staging ends (:meth:`ended`; ``running`` for
        # one handed out and not staged) or a request joins them. Told, not read from the
        # registry: a prefetch's name and lease are recorded after its key is queued (and
        # may be handed out), so a look there could find it no prefetch's and forget it
        # for good.
        self._running_low: set[str] = set()
        self._handed: set[str] = set()  # every key handed out, until its staging ends
        self._queued: dict[int, deque[str]] = {}
        self._askers: dict[str, set[int]] = {}  # each queued key: in whose turns it waits
        self._turn: deque[int] = deque()  # users with queued stagings, next first
        self._low: set[str] = set()  # queued keys only prefetches asked for
        # (key, user) a user's prefetch asked for and no request of theirs: what their
        # queue limits count apart (a key's own lowness is every asker's: it changes
        # as other users' requests and prefetches join it).
        self._prefetched: set[tuple[str, int]] = set()
        self._running: dict[int, int] = {}
        # Set on every change that may let a waiting worker go. Everything here runs on
        # the event loop, so nothing changes between a worker's look and its wait.
        self._changed = asyncio.Event()

    def put(self, key: str, owner: int, low: bool | None = None) -> None:
        """``owner`` asks for ``key``: it waits in their turn too. A request that is not
        a prefetch makes it no longer low. ``low``: a requeue's (None: PREFETCHING says)."""
        low = PREFETCHING.get() is not None if low is None else low
        if key not in self._askers and low:
            self._low.add(key)
        elif not low:
            self._low.discard(key)
            self._running_low.discard(key)  # (handed out, and its state not yet STAGING)
        askers = self._askers.setdefault(key, set())
        if not low:
            self._prefetched.discard((key, owner))
        if owner in askers:
            return
        askers.add(owner)
        if low:
            self._prefetched.add((key, owner))
        if owner not in self._queued:
            self._queued[owner] = deque()
            self._turn.append(owner)
        self._queued[owner].append(key)
        self._changed.set()

    def joined(self, key: str) -> None:
        """A request, not a prefetch, joined ``key``, which runs: it is the request's now
        (as a queued one is once a request asks for it), so it no longer takes a low
        slot; else bob's own request on his stalled prefetch would keep every other
        user's prefetch waiting for as long as his download lasts (the slot rule,
        STAGER_PREFETCH_SLOT_S, spares a staging a request joined)."""
        if PREFETCHING.get() is None and key in self._running_low:
            self._running_low.discard(key)
            self._changed.set()

    def left(self, key: str) -> None:
        """The last request on ``key`` left it to prefetches alone: it is low again, as it
        was before a request joined it; queued, it waits for a low slot, running, it
        takes one (else each join and leave of a prefetch ran one more on the node than
        its slots; a queued one, ahead of every other prefetch too)."""
        if key in self._askers:
            self._low.add(key)
        elif key in self._handed:
            self._running_low.add(key)

    def ended(self, key: str) -> None:
        """``key``'s staging ended (its worker says so, before any requeue or new queueing
        of the key): it takes no low slot from now on. ``running`` cannot tell: a key
        queued again (another name joined its cancel, or a new prefetch asked for it
        before any worker looked) is active, so it would hold its own slot, and with it
        every prefetch on the node, for as long as it waits."""
        self._handed.discard(key)
        if key in self._running_low:
            self._running_low.discard(key)
            self._changed.set()

    def discard(self, key: str, owner: int | None = None) -> None:
        """``owner`` no longer asks for a queued staging (None: nobody does)."""
        askers = self._askers.get(key, set())
        for asker in list(askers) if owner is None else [owner]:
            askers.discard(asker)
            self._withdraw(key, asker)
        if not askers:
            self._askers.pop(key, None)
            self._low.discard(key)

    def queued_by(self, owner: int, low: bool | None = None) -> int:
        """``owner``'s queued stagings: all (``low`` None), those only their prefetches
        asked for (True), or the others (False)."""
        queued = self._queued.get(owner, ())
        if low is None:
            return len(queued)
        return sum(1 for key in queued if ((key, owner) in self._prefetched) == low)

    def running_by(self, owner: int) -> int:
        return self._running.get(owner, 0)

    def __len__(self) -> int:
        return len(self._askers)

    async def get(self) -> tuple[str, int]:
        """The next staging and the user it is charged to (who goes to the back of the
        turn); low ones only when no user under the cap has another queued."""
        while True:
            chosen = self._next(low=False) or self._next(low=True)
            if chosen is not None:
                i, owner, key = chosen
                self._turn.rotate(-(i + 1))  # it, and those passed over, to the back
                for asker in self._askers.pop(key, {owner}):
                    self._withdraw(key, asker)
                self._handed.add(key)
                if key in self._low:
                    self._running_low.add(key)
                self._low.discard(key)
                self._running[owner] = self.running_by(owner) + 1
                return key, owner
            self._changed.clear()
            await self._changed.wait()

    def _next(self, low: bool) -> tuple[int, int, str] | None:
        """(place in turn, uid, key) of the first user under the cap with one queued."""
        if low and self.low_cap is not None:
            self._running_low = {k for k in self._running_low if self._still_running(k)}
            if len(self._running_low) >= self.low_cap:
                return None
        for i, owner in enumerate(self._turn):
            if self.running_cap is not None and self.running_by(owner) >= self.running_cap:
                continue
            key = next((k for k in self._queued[owner] if low or k not in self._low), None)
            if key is not None:
                return i, owner, key
        return None

    def finished(self, owner: int) -> None:
        left = self.running_by(owner) - 1
        if left > 0:
            self._running[owner] = left
        else:
            self._running.pop(owner, None)
        self._changed.set()

    def _withdraw(self, key: str, owner: int) -> None:
        self._prefetched.discard((key, owner))
        queued = self._queued.get(owner)
        if queued is not None and key in queued:
            queued.remove(key)
            if not queued:
                del self._queued[owner]
                self._turn.remove(owner)


class Admission:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        # Held by whatever decides an entry's fate, so an entry is never evicted between
        # being chosen and being answered.
        self.lock = asyncio.Lock()
        multi = settings.multi_user
        self.queue = FairQueue(
            settings.stagings_per_user() if multi else None,
            settings.prefetch_max_running,
            self._active,
        )
        self.max_queued = settings.max_queued_per_user if multi else None
        self._registry: Books | None = None
        self._held: Callable[[], Awaitable[Held]] | None = None
        self._exporting: Callable[[], set[str]] = set

    def bind(
        self,
        registry: Books,
        held: Callable[[], Awaitable[Held]],
        exporting: Callable[[], set[str]],
    ) -> None:
        self._registry, self._held, self._exporting = registry, held, exporting

    @property
    def _reg(self) -> Books:
        assert self._registry is not None, "admission is not bound to a registry yet"
        return self._registry

    # ---- slots ---------------------------------------------------------------------------

    def _active(self, key: str) -> bool:
        entry = self._reg.entries.get(key)
        return entry is not None and entry.active

    def prefetch_only(self, key: str) -> bool:
        """Whether every live name on ``key`` (one at least) is a prefetch's."""
        names = [h.id for h in self._reg.handles.values() if h.key == key and h.ended is None]
        return bool(names) and all(map(self.is_prefetch, names))

    def is_prefetch(self, handle_id: tuple[int, str]) -> bool:
        return any(
            x.handle_id == handle_id and x.holder.startswith(PREFETCH_HOLDER)
            for x in self._reg.leases.values()
        )

    def check_prefetch(self, estimate: int) -> None:
        """Refuse (429) a prefetch's staging of ``estimate`` bytes past its budgets."""
        budget = PREFETCHING.get()
        if budget is not None:
            budget(estimate)

    def check_queue(self, owner: int) -> None:
        """Refuse (429) a staging ``owner`` would queue past their limit. Prefetches and
        the user's own requests each have the limit: the planner's orders for a user's
        pending jobs never make their running job's request refused."""
        if self.max_queued is None:
            return
        low = PREFETCHING.get() is not None
        queued = self.queue.queued_by(owner, low)
        if queued >= self.max_queued and low:
            raise TooManyRequests(
                f"uid {owner} has {queued} prefetches queued on this node, the most one user "
                "may queue (--max-queued-per-user); the job stages when it starts"
            )
        if queued >= self.max_queued:
            raise TooManyRequests(
                f"you have {queued} stagings queued on this node, the most one user may "
                f"queue (--max-queued-per-user); wait for some to start, or cancel some "
                "(stager-client ls shows them)"
            )

    # ---- keys that stay -------------------------------------------------------------------

    def leased_or_active(self) -> set[str]:
        leased = {lease.key for lease in self._reg.leases.values()}
        return leased | {k for k, e in self._reg.entries.items() if e.active}

    def speculative(self) -> set[str]:
        """Leased keys whose every lease is a prefetch's: data for jobs not started, which
        may never start here. A request (not a prefetch) may evict it, as it would have
        evicted it without pre-staging: a prefetch never takes room from a running job."""
        only: dict[str, bool] = {}
        for lease in self._reg.leases.values():
            mine = lease.holder.startswith(PREFETCH_HOLDER)
            only[lease.key] = only.get(lease.key, True) and mine
        return {key for key, prefetched in only.items() if prefetched}

    def protected(self) -> set[str]:
        """Keys eviction must not touch: leased, being staged, or being packed to be sent."""
        return self.leased_or_active() | self._exporting()

    # ---- room ------------------------------------------------------------------------------

    async def free_bytes(self, held: Held) -> int:
        """Free bytes for new data: trees being deleted count as free already (or every
        request during a large deletion would evict more than it needs), room promised
        to transfers and not written yet does not."""
        free = await run_io(preflight.free_bytes, self.settings)
        return free + self._reg.trash.freeing_bytes - held.unwritten_bytes

    async def free_inodes(self) -> int | None:
        """As :meth:`free_bytes`, in inodes; None where the disk keeps no count."""
        free = await run_io(preflight.free_inodes, self.settings)
        return None if free is None else free + self._reg.trash.freeing_inodes

    async def _make_inode_room(self, key: str, owner: int | None, protected: set[str]) -> None:
        """:meth:`make_room` for ``ADMIT_INODES`` inodes."""
        settings, need = self.settings, cache.ADMIT_INODES
        entries = list(self._reg.entries.values())
        quota = settings.user_inode_quota
        if owner is not None and quota:
            own = [e for e in entries if cache.private_owner(e) == owner]
            must_free = sum(cache.inodes_held(e) for e in own) + need - quota
            if must_free > 0:
                for victim in cache.plan_inodes(must_free, cache.evictable(own, protected)):
                    await self._reg.evict(victim, f"to keep uid {owner} within --user-inode-quota")
        if settings.min_free_inodes:
            free = await self.free_inodes()
            if free is None:
                return
            must_free = settings.min_free_inodes + need - free
            if must_free > 0:
                candidates = cache.evictable(self._reg.entries.values(), protected)
                for victim in cache.plan_inodes(must_free, candidates):
                    await self._reg.evict(
                        victim, f"to keep inodes above --min-free-inodes for {key}"
                    )

    async def make_room(
        self, estimate: int, key: str, owner: int | None = None, request: bool = False
    ) -> None:
        """Make room for a new staging (or a transfer's: ``key`` empty) by evicting LRU
        entries, or refuse with the sizes. ``owner``'s quota comes first, and only their
        own data goes for it. ``request``: a user's staging, not a prefetch's, which may
        evict data only prefetches hold (:meth:`speculative`). Call it holding :attr:`lock`."""
        assert self._held is not None
        held = await self._held()
        protected = self.leased_or_active() | held.exporting | {key}
        if request:
            active = {k for k, e in self._reg.entries.items() if e.active}
            protected -= self.speculative() - active - held.exporting - {key}
        entries = list(self._reg.entries.values())
        if owner is not None and self.settings.user_quota_bytes:
            for victim in cache.plan_quota(
                estimate + held.reserved_by.get(owner, 0),
                owner,
                entries,
                protected,
                self.settings.user_quota_bytes,
                still_held=self._reg.held.bytes_of(owner),
            ):
                await self._reg.evict(victim, f"to keep uid {owner} within --user-quota")
        plan = cache.plan_admission(
            needed=estimate,
            entries=list(self._reg.entries.values()),
            protected=protected,
            capacity_bytes=self.settings.capacity_bytes,
            free_bytes=await self.free_bytes(held),
            min_free_bytes=self.settings.min_free_bytes,
            still_held=self._reg.held.total_bytes,
        )
        for victim in plan:
            why = f"to make room for {key}" if key else "to bring the cache back under its limits"
            await self._reg.evict(victim, why)
        if key:  # a staging (a transfer's room is bytes only)
            await self._make_inode_room(key, owner, protected)


def owner_of(entry: Any) -> int:
    """Whose turn a staging takes: the user it is read as, or -1 (the daemon's own)."""
    reader = entry.reader
    return reader.uid if reader is not None else -1
