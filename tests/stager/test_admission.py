"""Admission's own contract, without a daemon: the fair queue's turns, caps and low
stagings, the queue limit's refusal, the keys that stay, and room made by evicting the
least recently used entries nobody holds (stager/engine/admission.py)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from stager.core.errors import InsufficientSpace, TooManyRequests
from stager.core.settings import Settings
from stager.engine.admission import PREFETCHING, Admission, FairQueue, Held
from stager.state.dataset import Entry
from stager.state.leases import Lease
from stager.wire.schemas import State

MB = 1_000_000


async def order(queue: FairQueue, n: int) -> list[tuple[str, int]]:
    """The next ``n`` stagings the queue hands out, each finished at once."""
    out = []
    for _ in range(n):
        key, owner = await asyncio.wait_for(queue.get(), 1)
        queue.finished(owner)
        out.append((key, owner))
    return out


def test_users_take_turns_whatever_one_of_them_queued() -> None:
    async def go() -> list[tuple[str, int]]:
        queue = FairQueue()
        for i in range(4):
            queue.put(f"a{i}", 1)  # user 1 queued four before user 2 asked
        queue.put("b0", 2)
        queue.put("b1", 2)
        return await order(queue, 6)

    assert asyncio.run(go()) == [("a0", 1), ("b0", 2), ("a1", 1), ("b1", 2), ("a2", 1), ("a3", 1)]


def test_a_user_at_the_cap_is_passed_over_until_a_staging_of_theirs_ends() -> None:
    async def go() -> None:
        queue = FairQueue(running_cap=1)
        queue.put("a0", 1)
        queue.put("a1", 1)
        queue.put("b0", 2)
        assert await queue.get() == ("a0", 1)
        assert await queue.get() == ("b0", 2)  # user 1 runs one already
        waiting = asyncio.ensure_future(queue.get())
        await asyncio.sleep(0.01)
        assert not waiting.done() and queue.running_by(1) == 1
        queue.finished(1)  # their slot is free: the worker waiting wakes
        assert await asyncio.wait_for(waiting, 1) == ("a1", 1)

    asyncio.run(go())


def test_a_join_runs_in_the_first_turn_of_any_of_its_askers_and_leaves_the_others() -> None:
    async def go() -> None:
        queue = FairQueue()
        queue.put("a0", 1)
        queue.put("a1", 1)
        queue.put("b0", 2)
        queue.put("a1", 2)  # user 2 joins user 1's second staging
        assert len(queue) == 3 and queue.queued_by(2) == 2
        assert await order(queue, 2) == [("a0", 1), ("b0", 2)]
        # user 1's turn is next, and a1 is theirs: it runs, charged to them, and
        # leaves user 2's turn, so the queue is empty.
        assert await order(queue, 1) == [("a1", 1)]
        assert len(queue) == 0 and queue.queued_by(2) == 0

    asyncio.run(go())


def test_a_prefetch_runs_only_when_nothing_else_is_queued_and_a_request_raises_it() -> None:
    async def go() -> None:
        queue = FairQueue()
        token = PREFETCHING.set(True)
        queue.put("p0", 3)
        queue.put("p1", 3)
        PREFETCHING.reset(token)
        queue.put("u0", 1)
        assert await order(queue, 1) == [("u0", 1)]  # though p0 was queued first
        queue.put("p1", 1)  # a user's own request for it: no longer low
        queue.put("u1", 1)
        # User 3's turn comes first now (user 1 just ran): p1 runs in it, passing the
        # low p0; then user 1's own; the prefetch last.
        assert await order(queue, 3) == [("p1", 3), ("u1", 1), ("p0", 3)]

    asyncio.run(go())


def test_a_running_prefetch_a_request_joins_leaves_its_low_slot_to_the_next() -> None:
    """One low slot: bob's prefetch p0 runs in it, and p1 waits. A prefetch asking for
    p0 again changes nothing; bob's own request joining it makes it his request's, and
    p1 runs. Nothing the queue reads decides it (the registry's names and leases come
    after a key is handed out): it counts what it handed out until the key ends."""

    async def go() -> None:
        running = {"p0", "p1"}
        queue = FairQueue(low_cap=1, running=running.__contains__)
        token = PREFETCHING.set(True)
        queue.put("p0", 2)
        queue.put("p1", 1)
        assert await asyncio.wait_for(queue.get(), 1) == ("p0", 2)
        waiting = asyncio.ensure_future(queue.get())
        await asyncio.sleep(0.01)
        queue.joined("p0")  # a prefetch's: still low
        PREFETCHING.reset(token)
        await asyncio.sleep(0.01)
        assert not waiting.done()
        queue.joined("p0")  # bob's own request: the slot is p1's
        assert await asyncio.wait_for(waiting, 1) == ("p1", 1)

    asyncio.run(go())


def test_a_low_key_queued_again_as_its_staging_ended_takes_the_slot_it_left() -> None:
    """One low slot: p0 runs in it; its staging ends (cancelled) and another prefetch's
    name joined meanwhile, so it is queued again at once, before any worker looked (it
    is active then). Its worker said it ended: p0 runs again, not waits for itself."""

    async def go() -> None:
        queue = FairQueue(low_cap=1, running=lambda key: True)  # queued again: active
        token = PREFETCHING.set(True)
        queue.put("p0", 1)
        assert await asyncio.wait_for(queue.get(), 1) == ("p0", 1)
        queue.ended("p0")
        queue.put("p0", 2)
        queue.finished(1)
        assert await asyncio.wait_for(queue.get(), 1) == ("p0", 2)
        PREFETCHING.reset(token)

    asyncio.run(go())


def test_a_discarded_staging_leaves_every_turn() -> None:
    queue = FairQueue()
    queue.put("k", 1)
    queue.put("k", 2)
    queue.discard("k", 1)  # one asker leaves: it still waits in the other's turn
    assert len(queue) == 1 and queue.queued_by(1) == 0 and queue.queued_by(2) == 1
    queue.discard("k")  # cancelled
    assert len(queue) == 0 and queue.queued_by(2) == 0


@dataclass
class _Trash:
    freeing_bytes: int = 0
    freeing_inodes: int = 0


@dataclass
class _Held:
    by_owner: dict[int, int] = field(default_factory=dict)

    def bytes_of(self, owner: int) -> int:
        return self.by_owner.get(owner, 0)

    @property
    def total_bytes(self) -> int:
        return sum(self.by_owner.values())


@dataclass
class Books:
    """The registry as admission sees it (admission.Books), keeping what it evicts."""

    entries: dict[str, Entry] = field(default_factory=dict)
    leases: dict[str, Lease] = field(default_factory=dict)
    trash: _Trash = field(default_factory=_Trash)
    held: _Held = field(default_factory=_Held)
    evicted: list[str] = field(default_factory=list)

    async def evict(self, entry: Entry, why: str = "") -> None:
        self.evicted.append(entry.key)
        entry.state = State.EVICTED
        del self.entries[entry.key]


def ready(books: Books, key: str, size: int, age_s: int) -> Entry:
    made = Entry(key=key, spec={}, steps=[], verify="size", state=State.READY)
    made.size_bytes = size
    made.last_used_at = datetime.now(UTC) - timedelta(seconds=age_s)
    books.entries[key] = made
    return made


def bound(tmp_path: Path, exporting: set[str] = frozenset(), **settings: object) -> Admission:
    admission = Admission(Settings(cache_dir=tmp_path, runtime_dir=tmp_path, **settings))
    books = Books()
    reserved = Held(unwritten_bytes=0, exporting=set(exporting), reserved_by={})

    async def held() -> Held:
        return reserved

    admission.bind(books, held, lambda: set(exporting))
    return admission


def books_of(admission: Admission) -> Books:
    return admission._reg  # type: ignore[return-value]


def test_room_is_made_from_the_least_recently_used_that_nobody_holds(tmp_path: Path) -> None:
    admission = bound(tmp_path, exporting={"packed"}, capacity_bytes=300 * MB, min_free_bytes=0)
    books = books_of(admission)
    for key, age in (("oldest", 400), ("leased", 300), ("packed", 200), ("old", 100), ("new", 1)):
        ready(books, key, 60 * MB, age)
    books.leases["l"] = Lease(id="l", name="n", key="leased", holder="h", owner=1)
    assert admission.protected() == {"leased", "packed"}
    # 300 MB held, 300 MB allowed: 100 MB more must free 100 MB, two entries of 60.
    asyncio.run(admission.make_room(100 * MB, "incoming"))
    assert books.evicted == ["oldest", "old"]


def test_room_that_cannot_be_made_is_refused_and_nothing_is_evicted(tmp_path: Path) -> None:
    admission = bound(tmp_path, capacity_bytes=100 * MB, min_free_bytes=0)
    books = books_of(admission)
    ready(books, "leased", 90 * MB, 10)
    books.leases["l"] = Lease(id="l", name="n", key="leased", holder="h", owner=1)
    with pytest.raises(InsufficientSpace):
        asyncio.run(admission.make_room(50 * MB, "incoming"))
    assert books.evicted == []


def test_a_user_past_their_queue_limit_is_refused(tmp_path: Path) -> None:
    admission = bound(tmp_path, multi_user=True, max_queued_per_user=2)
    admission.queue.put("a", 7)
    admission.check_queue(7)
    admission.queue.put("b", 7)
    with pytest.raises(TooManyRequests, match="2 stagings queued"):
        admission.check_queue(7)
    admission.check_queue(8)  # another user's queue is theirs
    assert bound(tmp_path).max_queued is None  # a per-user daemon has no such limit


def test_what_a_users_prefetch_asks_for_counts_as_her_prefetch_whoever_else_asks(
    tmp_path: Path,
) -> None:
    """A queued key's lowness is every asker's: bob's request that a prefetch of
    alice's joins, or that joins hers, is not low, and each was counted as a request of
    hers, filling her requests' limit (her running job's own was refused, 429)."""
    admission = bound(tmp_path, multi_user=True, max_queued_per_user=2)
    alice, bob = 7, 8
    admission.queue.put("his", bob)  # bob's own request
    token = PREFETCHING.set(lambda _estimate: None)
    try:
        admission.queue.put("his", alice)  # her prefetch joins it
        admission.queue.put("hers", alice)  # her prefetch, queued first
    finally:
        PREFETCHING.reset(token)
    admission.queue.put("hers", bob)  # his request joins it: it is no longer low
    assert admission.queue.queued_by(alice, low=True) == 2
    assert admission.queue.queued_by(alice, low=False) == 0
    admission.check_queue(alice)  # her own request is taken
    admission.queue.put("hers", alice)  # her own request for it: hers is a request now
    assert admission.queue.queued_by(alice, low=False) == 1
    admission.queue.discard("his", alice)
    assert admission.queue.queued_by(alice, low=True) == 0
