"""Admission: who gets room on the cache disk and a staging slot, decided in one place.

One object, one lock (:attr:`Admission.lock`), called by the engine and by the
fan-out room alike:

- **Room** (:meth:`Admission.make_room`): what a new staging or a transfer's
  reservation needs, made by evicting ready entries nobody holds, least recently
  used first: the user's own first, to keep them in their quota, then any, to keep
  the cache in its capacity and the disk above its floor; or refused with the sizes.
- **Protected keys** (:meth:`Admission.protected`): leased (by any of their names),
  being staged, or being packed to be sent: never evicted.
- **Slots** (:class:`FairQueue`): queued stagings wait per user and are served
  round-robin between users, so one user's hundred queued stagings delay another's
  one by at most one staging per slot. A staging several users asked for (a join)
  waits in the turn of each of them and runs in the first of those turns to come,
  so a join never runs later than the joiner's own staging would have. In the node
  service each user runs at most ``max_stagings_per_user`` at once (so that slots
  are always left for others) and queues at most ``max_queued_per_user``; a request
  past that is refused (429). A prefetch (a staging for a job not started yet,
  stager.prestage.prefetch) is **low**: it runs only when no other staging is queued, at most
  ``prefetch_max_running`` at once, and stops being low as soon as any request not a
  prefetch asks for it. Requeued (after a restart, a cancel another name outlived) it
  stays low while every live name on it is a prefetch's (it holds a prefetch's lease).
- **Prefetch budgets** (:meth:`Admission.check_prefetch`): a prefetch past its bytes
  budget is refused before anything is queued, named or written.

Reservations held by transfers come from the fan-out room (``held``): room promised
and not written yet is not free, and counts against its user's quota. Space evicted
datasets still hold (a lazily unmounted image, a deleted tree's open files:
stager.engine.held_space) counts against its user's quota until it is freed, and is never
room that eviction can make.
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
# (raises past it, given the staging's estimate): the stagings it queues are low. A
# context variable rather than a parameter through the engine: only admission reads it,
# and the engine's request path stays the very one a user's request takes.
PREFETCHING: ContextVar[Callable[[int], None] | None] = ContextVar(
    "stager_prefetching", default=None
)
# The lease a prefetch holds on its name until its job uses it (stager.prestage.prefetch): how a
# requeued staging is known to be a prefetch's. A user who gives their own lease such a
# holder makes only their own staging low.
PREFETCH_HOLDER = "prefetch-job-"


@dataclass(frozen=True)
class Held:
    """What admission must not count as free or evict, from the fan-out room: room
    promised to transfers and not written yet, and the keys of datasets being packed to
    be sent."""

    unwritten_bytes: int
    exporting: set[str]
    reserved_by: dict[int, int]  # the bytes each user's transfers hold, for their quota


class _Trash(Protocol):
    freeing_bytes: int
    freeing_inodes: int


class _HeldSpace(Protocol):
    """Space evicted datasets still hold (stager.engine.held_space.HeldSpace)."""

    def bytes_of(self, owner: int) -> int: ...

    @property
    def total_bytes(self) -> int: ...


class Books(Protocol):
    """What admission reads and does of the registry (stager.engine.lifecycle.Registry)."""

    entries: dict[str, Entry]
    handles: dict[tuple[int, str], Handle]
    leases: dict[str, Lease]
    trash: _Trash

    @property
    def held(self) -> _HeldSpace: ...

    async def evict(self, entry: Entry, why: str = ...) -> None: ...


class FairQueue:
    """Stagings waiting for a slot, per user, served round-robin between users.

    A staging waits in the turn of every user who asked for it (its askers: the first,
    and each user who joined it while it was queued), and runs in the first of their
    turns that comes while that user is under the cap. It is charged to that user, as
    their own staging would have been: the turn it took was theirs, and it gave them
    what they asked for. ``running_cap``: the most stagings one user runs at once (None:
    no cap); ``low_cap``: the most low stagings (prefetches) running at once, so that a
    burst of them never takes every slot (``running``: whether a key still runs)."""

    def __init__(
        self,
        running_cap: int | None = None,
        low_cap: int | None = None,
        running: Callable[[str], bool] = lambda key: True,
    ) -> None:
        self.running_cap = running_cap
        self.low_cap, self._still_running = low_cap, running
        self._running_low: set[str] = set()  # low keys handed out, until they end
        self._queued: dict[int, deque[str]] = {}
        self._askers: dict[str, set[int]] = {}  # each queued key: in whose turns it waits
        self._turn: deque[int] = deque()  # users with queued stagings, next first
        self._low: set[str] = set()  # queued keys only prefetches asked for
        self._running: dict[int, int] = {}
        # Set on every change that may let a waiting worker go. Everything here runs on
        # the event loop, so nothing changes between a worker's look and its wait.
        self._changed = asyncio.Event()

    def put(self, key: str, owner: int, low: bool | None = None) -> None:
        """``owner`` asks for ``key`` (queued anew, or joined): it waits in their turn
        too. Asking twice changes nothing, except that a request that is not a prefetch
        makes the staging no longer low. ``low``: a requeue's own lowness (None: a new
        request's, a prefetch's when PREFETCHING is set)."""
        low = PREFETCHING.get() is not None if low is None else low
        if key not in self._askers and low:
            self._low.add(key)
        elif not low:
            self._low.discard(key)
        askers = self._askers.setdefault(key, set())
        if owner in askers:
            return
        askers.add(owner)
        if owner not in self._queued:
            self._queued[owner] = deque()
            self._turn.append(owner)
        self._queued[owner].append(key)
        self._wake()

    def discard(self, key: str, owner: int | None = None) -> None:
        """``owner`` no longer asks for a queued staging (None: nobody does, it was
        cancelled before it ran)."""
        askers = self._askers.get(key, set())
        for asker in list(askers) if owner is None else [owner]:
            askers.discard(asker)
            self._withdraw(key, asker)
        if not askers:
            self._askers.pop(key, None)
            self._low.discard(key)

    def queued_by(self, owner: int) -> int:
        return len(self._queued.get(owner, ()))

    def running_by(self, owner: int) -> int:
        return self._running.get(owner, 0)

    def __len__(self) -> int:
        return len(self._askers)

    async def get(self) -> tuple[str, int]:
        """The next staging to run and the user it is charged to: the first user in
        turn who has one queued and is under the cap; that user goes to the back of the
        turn, and the staging leaves every other asker's turn. Low stagings (prefetches)
        only when no user under the cap has another queued."""
        while True:
            chosen = self._next(low=False) or self._next(low=True)
            if chosen is not None:
                i, owner, key = chosen
                self._turn.rotate(-(i + 1))  # it, and those passed over, to the back
                for asker in self._askers.pop(key, {owner}):
                    self._withdraw(key, asker)
                if key in self._low:
                    self._running_low.add(key)
                self._low.discard(key)
                self._running[owner] = self.running_by(owner) + 1
                return key, owner
            self._changed.clear()
            await self._changed.wait()

    def _next(self, low: bool) -> tuple[int, int, str] | None:
        """The first user in turn under the cap with a staging queued (``low``: a low one
        too), as (their place in turn, uid, key)."""
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
        """A staging charged to ``owner`` has ended: their slot is free."""
        left = self.running_by(owner) - 1
        if left > 0:
            self._running[owner] = left
        else:
            self._running.pop(owner, None)
        self._wake()

    def _withdraw(self, key: str, owner: int) -> None:
        queued = self._queued.get(owner)
        if queued is not None and key in queued:
            queued.remove(key)
            if not queued:
                del self._queued[owner]
                self._turn.remove(owner)

    def _wake(self) -> None:
        self._changed.set()


class Admission:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        # Held by whatever decides an entry's fate: admission, joins and hits, leases,
        # eviction; so an entry is never evicted between being chosen and being answered.
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
        """What admission reads: the registry's entries and leases (once it has loaded
        them), and the fan-out room's reservations and keys being packed."""
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
        """Whether every live name on ``key`` (one at least) is a prefetch's: a requeued
        staging's lowness, known from the names and leases the registry keeps."""
        names = [h.id for h in self._reg.handles.values() if h.key == key and h.ended is None]
        return bool(names) and all(map(self.is_prefetch, names))

    def is_prefetch(self, handle_id: tuple[int, str]) -> bool:
        return any(
            x.handle_id == handle_id and x.holder.startswith(PREFETCH_HOLDER)
            for x in self._reg.leases.values()
        )

    def check_prefetch(self, estimate: int) -> None:
        """Refuse (429) a prefetch's staging of ``estimate`` bytes past its budgets,
        before anything is queued or named (nothing for a request not a prefetch)."""
        budget = PREFETCHING.get()
        if budget is not None:
            budget(estimate)

    def check_queue(self, owner: int) -> None:
        """Refuse (429) a staging ``owner`` would queue past their limit."""
        if self.max_queued is None:
            return
        queued = self.queue.queued_by(owner)
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

    def protected(self) -> set[str]:
        """Keys eviction must not touch: leased, being staged, or being packed to be sent."""
        return self.leased_or_active() | self._exporting()

    # ---- room ------------------------------------------------------------------------------

    async def free_bytes(self, held: Held) -> int:
        """What the cache's disk holds free for new data now: trees being deleted count as
        free already (or every request during a large deletion would evict more than it
        needs), room promised to deliveries and exports and not written yet does not."""
        free = await run_io(preflight.free_bytes, self.settings)
        return free + self._reg.trash.freeing_bytes - held.unwritten_bytes

    async def free_inodes(self) -> int | None:
        """The cache disk's free inodes, those of trees being deleted counted free
        already (as :meth:`free_bytes`); None where the disk keeps no count."""
        free = await run_io(preflight.free_inodes, self.settings)
        return None if free is None else free + self._reg.trash.freeing_inodes

    async def _make_inode_room(self, key: str, owner: int | None, protected: set[str]) -> None:
        """Evict unleased LRU entries so that a new staging has ``ADMIT_INODES`` inodes
        under its user's inode quota (their own entries) and above the disk's inode floor
        (any), as :meth:`make_room` does for bytes."""
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

    async def make_room(self, estimate: int, key: str, owner: int | None = None) -> None:
        """Make room for a new staging (or a transfer's room: ``key`` empty), evicting LRU
        entries, or refuse it with the sizes. ``owner``: the uid whose own data or room it
        is (node service), held to their quota first, which counts their own entries and
        their transfers' room: it evicts only their own data for it. Call it holding
        :attr:`lock`."""
        assert self._held is not None
        held = await self._held()
        protected = self.leased_or_active() | held.exporting | {key}
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
    """Whose turn a staging takes in the fair queue: the user it is read as (the first
    to ask for a shared one), or the daemon's own user (-1) in per-user mode."""
    reader = entry.reader
    return reader.uid if reader is not None else -1
