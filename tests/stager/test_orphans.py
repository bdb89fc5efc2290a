"""What a starting daemon finds that no entry owns is moved aside at once (so a new
staging of the same key starts in a fresh folder) and deleted afterwards."""

from __future__ import annotations

import asyncio
from pathlib import Path

from stager.core.durable import CrashPoints
from stager.core.metrics import Metrics
from stager.core.settings import Settings
from stager.engine.lifecycle import Registry, Trash
from stager.ops import table
from stager.request import preflight
from stager.state.dataset import Entry
from stager.state.store import Store
from stager.wire.schemas import State
from tests.trees import write_tree


def entry(key: str, state: State, attempt: str | None = None) -> Entry:
    return Entry(key=key, spec={}, steps=[], verify="size", state=state, attempt=attempt)


def test_orphans_are_moved_aside_before_the_daemon_answers(tmp_path: Path) -> None:
    settings = Settings(cache_dir=tmp_path / "cache", runtime_dir=tmp_path / "run")
    preflight.ensure_dirs(settings)
    store = Store(settings.db_path, table.load())
    for stored in (
        entry("a" * 24, State.EVICTED, "old"),  # its attempt's data a failed cleanup left
        entry("b" * 24, State.STAGING, "cur"),  # interrupted: resumed in its attempt, kept
        entry("c" * 24, State.READY),  # published: kept
        entry("d" * 24, State.EVICTED),  # eviction recorded, tree not yet moved
        entry("f" * 24, State.QUEUED, "cur"),  # queued again after a crash: an OLD attempt
    ):
        store.save_entry(stored)
    partial, data = settings.partial_dir, settings.data_dir
    for folder in (
        partial / f"{'a' * 24}.old",
        partial / f"{'b' * 24}.cur",
        partial / f"{'b' * 24}.older",  # an attempt that is not the entry's current one
        partial / f"{'f' * 24}.gone",
        data / ("c" * 24),
        data / ("d" * 24),
    ):
        write_tree(folder / "tree", n_files=3)
    write_tree(partial / f"discarded-{'e' * 24}-0123abcd", n_files=3)

    async def load() -> tuple[list[str], list[str], list[str]]:
        tasks: set[asyncio.Task] = set()
        trash = Trash(partial, lambda coro, name: tasks.add(asyncio.create_task(coro)))
        registry = Registry(settings, store, Metrics(), trash, CrashPoints(None))
        resumed = [e.key for e in await registry.load()]
        # Right after the start, before any background delete ran: names are free.
        kept = sorted(p.name for p in partial.iterdir() if not p.name.startswith("discarded-"))
        published = sorted(p.name for p in data.iterdir())
        await asyncio.gather(*tasks)
        return resumed, kept, published

    resumed, kept, published = asyncio.run(load())
    assert sorted(resumed) == ["b" * 24, "f" * 24]
    assert kept == [f"{'b' * 24}.cur"]
    assert published == ["c" * 24]
    assert list(partial.iterdir()) == [partial / f"{'b' * 24}.cur"]  # the rest deleted
