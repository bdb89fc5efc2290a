"""A cache hit moves its entry in LRU order at once, in memory; the store hears of it at
most every ``recency_persist_s``, so a burst of hits costs one write and a crash can
leave eviction order no staler than that."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from stager.core.durable import CrashPoints
from stager.core.metrics import Metrics
from stager.core.settings import Settings
from stager.engine.lifecycle import Registry, Trash
from stager.ops import table
from stager.request import preflight
from stager.state.cache import evictable
from stager.state.dataset import Entry
from stager.state.store import Store
from stager.wire.schemas import State


def registry(tmp_path: Path, persist_s: float) -> tuple[Registry, Store]:
    settings = Settings(
        cache_dir=tmp_path / "cache", runtime_dir=tmp_path / "run", recency_persist_s=persist_s
    )
    preflight.ensure_dirs(settings)
    store = Store(settings.db_path, table.load())
    trash = Trash(settings.partial_dir, lambda coro, name: coro.close())
    return Registry(settings, store, Metrics(), trash, CrashPoints(None)), store


def stored_last_use(store: Store) -> dict[str, float]:
    entries, _, _ = store.load()
    return {e.key: e.last_used_at.timestamp() for e in entries}


async def two_ready_entries(reg: Registry) -> tuple[Entry, Entry]:
    older, newer = (
        Entry(key=k * 24, spec={}, steps=[], verify="size", state=State.READY) for k in "ab"
    )
    for entry in (older, newer):
        await reg.queue(entry)
        entry.state = State.READY
        time.sleep(0.002)  # distinct times
    return older, newer


def test_a_burst_of_hits_writes_recency_once_and_eviction_sees_every_hit(tmp_path: Path) -> None:
    reg, store = registry(tmp_path, persist_s=30.0)
    writes = 0
    save_entry = store.save_entry

    def counting(entry: Entry) -> None:
        nonlocal writes
        writes += 1
        save_entry(entry)

    store.save_entry = counting  # type: ignore[method-assign]

    async def run() -> None:
        older, newer = await two_ready_entries(reg)
        before = writes
        for _ in range(50):
            await reg.touch(older)
        assert writes - before == 1, "50 hits within the interval: one write"
        # Eviction goes by memory: the entry just hit is the last to go.
        assert [e.key for e in evictable(reg.entries.values(), set())] == [
            newer.key,
            older.key,
        ]
        # What the store holds is no staler than the first hit of the burst.
        assert stored_last_use(store)[older.key] > stored_last_use(store)[newer.key]

    asyncio.run(run())


def test_recency_is_written_again_once_the_interval_has_passed(tmp_path: Path) -> None:
    reg, store = registry(tmp_path, persist_s=0.05)

    async def run() -> None:
        older, _ = await two_ready_entries(reg)
        await reg.touch(older)
        first = stored_last_use(store)[older.key]
        await reg.touch(older)
        assert stored_last_use(store)[older.key] == first
        await asyncio.sleep(0.06)
        await reg.touch(older)
        assert stored_last_use(store)[older.key] == older.last_used_at.timestamp() > first

    asyncio.run(run())
