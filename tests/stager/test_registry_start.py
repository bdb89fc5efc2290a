"""A worker moves the queued entry it took from the queue to STAGING in the same step
(``Registry.begin``), then ``Registry.start`` looks for the attempt to resume: a request
or a cancel arriving meanwhile finds it staging. (Found QUEUED there, a request put it in
the queue again, and a second worker failed the staging that ran: STAGING -> STAGING.)"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from stager.core.durable import CrashPoints
from stager.core.identity import Caller
from stager.core.metrics import Metrics
from stager.core.settings import Settings
from stager.engine.lifecycle import Registry, Trash
from stager.engine.names import Names
from stager.engine.scheduler import Engine
from stager.ops import table
from stager.request import preflight
from stager.state.dataset import Entry, Handle
from stager.state.store import Store
from stager.wire.schemas import State


def cache(tmp_path: Path) -> tuple[Settings, Store]:
    """The settings of a cache in ``tmp_path``, its folders made, and its store."""
    settings = Settings(cache_dir=tmp_path / "cache", runtime_dir=tmp_path / "run")
    preflight.ensure_dirs(settings)
    return settings, Store(settings.db_path, table.load())


def test_a_started_entry_resumes_the_attempt_whose_folder_is_there(tmp_path: Path) -> None:
    settings, store = cache(tmp_path)
    trash = Trash(settings.partial_dir, lambda coro, name: coro.close())
    reg = Registry(settings, store, Metrics(), trash, CrashPoints(None))

    async def run() -> None:
        entry = Entry(key="k" * 24, spec={}, steps=[], verify="size", state=State.QUEUED)
        await reg.queue(entry)
        entry.attempt = "interrupted1"  # an attempt a restart left, to resume
        reg.attempt(entry).root.mkdir(parents=True)
        reg.begin(entry)
        attempt = await reg.start(entry)
        assert entry.state == State.STAGING
        assert entry.attempt == "interrupted1" and attempt.root.is_dir()  # resumed
        entry.attempt = "gone"  # one whose folder is not there: a new attempt
        assert (await reg.start(entry)).root.name != f"{entry.key}.gone"

    try:
        asyncio.run(run())
    finally:
        store.close()


def test_a_worker_moves_what_it_took_from_the_queue_to_staging_in_the_same_step(
    tmp_path: Path,
) -> None:
    settings, store = cache(tmp_path)
    trash = Trash(settings.partial_dir, lambda coro, name: coro.close())
    engine = Engine(settings, Metrics())
    engine.registry = Registry(settings, store, Metrics(), trash, CrashPoints(None))

    async def run() -> State:
        entry = Entry(key="k" * 24, spec={}, steps=[], verify="size", state=State.QUEUED)
        await engine.reg.queue(entry)
        engine.admission.queue.put(entry.key, 0, low=False)
        worker = asyncio.ensure_future(engine._worker())
        await asyncio.sleep(0)  # the worker took the key; its staging's task has not run
        # A request or a second worker (one whose step came next, back from its staging)
        # that found it queued here put it in the queue again, and that worker failed
        # the staging that ran (STAGING -> STAGING).
        seen = entry.state
        worker.cancel()
        await asyncio.gather(worker, return_exceptions=True)
        return seen

    try:
        assert asyncio.run(run()) == State.STAGING
    finally:
        store.close()


class _GatedTrash(Trash):
    """Holds a discard until the test lets it go: the cancel's await, made long."""

    def __init__(self, trash_dir: Path) -> None:
        super().__init__(trash_dir, lambda coro, name: coro.close())
        self.entered, self.go = asyncio.Event(), asyncio.Event()

    async def discard(self, path: Path, *args: Any, **kwargs: Any) -> bool:
        self.entered.set()
        await self.go.wait()
        return await super().discard(path, *args, **kwargs)


def test_a_worker_free_while_a_cancel_ends_a_queued_entry_does_not_take_it(
    tmp_path: Path,
) -> None:
    settings, store = cache(tmp_path)
    trash = _GatedTrash(settings.partial_dir)
    engine = Engine(settings, Metrics())
    engine.registry = Registry(settings, store, Metrics(), trash, CrashPoints(None))
    names = Names(engine)
    uid = os.getuid()

    async def run() -> tuple[State, State]:
        entry = Entry(key="k" * 24, spec={}, steps=[], verify="size", state=State.QUEUED)
        await engine.reg.queue(entry)
        entry.attempt = "interrupted1"  # its partial data, which the cancel deletes first
        engine.reg.attempt(entry).root.mkdir(parents=True)
        await engine.reg.name(Handle(name="d", key=entry.key, spec_key="s", owner=uid))
        engine.admission.queue.put(entry.key, uid, low=False)
        cancel = asyncio.ensure_future(names.delete("d", Caller(uid=uid, gid=os.getgid())))
        await trash.entered.wait()  # the cancel deletes the attempt; the entry is queued
        worker = asyncio.ensure_future(engine._worker())  # one back from its staging
        for _ in range(3):
            await asyncio.sleep(0)
        seen = entry.state  # taken, it would be staging, and the cancel then ended it so
        trash.go.set()
        await cancel
        worker.cancel()
        await asyncio.gather(worker, return_exceptions=True)
        return seen, entry.state

    try:
        assert asyncio.run(run()) == (State.QUEUED, State.CANCELLED)
    finally:
        store.close()
