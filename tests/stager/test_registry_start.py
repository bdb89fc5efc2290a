"""A worker hands a queued entry to ``Registry.start``: the entry is STAGING before
start's first await, so a request or a cancel arriving while it looks for the attempt
to resume finds it staging. (Found QUEUED there, a request put it in the queue again,
and a second worker failed the staging that ran: STAGING -> STAGING.)"""

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


def test_a_resumed_attempt_is_staging_before_start_looks_for_its_folder(tmp_path: Path) -> None:
    settings = Settings(cache_dir=tmp_path / "cache", runtime_dir=tmp_path / "run")
    preflight.ensure_dirs(settings)
    store = Store(settings.db_path, table.load())
    trash = Trash(settings.partial_dir, lambda coro, name: coro.close())
    reg = Registry(settings, store, Metrics(), trash, CrashPoints(None))

    async def run() -> None:
        entry = Entry(key="k" * 24, spec={}, steps=[], verify="size", state=State.QUEUED)
        await reg.queue(entry)
        entry.attempt = "interrupted1"  # an attempt a restart left, to resume
        reg.attempt(entry).root.mkdir(parents=True)
        start = asyncio.ensure_future(reg.start(entry))
        await asyncio.sleep(0)  # start runs to its first await (the folder's look)
        assert entry.state == State.STAGING, "a request arriving now would queue it again"
        attempt = await start
        assert entry.attempt == "interrupted1" and attempt.root.is_dir()  # resumed

    asyncio.run(run())
