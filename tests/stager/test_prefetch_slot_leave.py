"""A running prefetch that another user's request joined takes no prefetch slot; once
that request's name is deleted, the staging is the prefetches' alone again and takes
its slot again (``FairQueue.left``, told by ``Names.delete``). Before, each join and
leave of a running prefetch let one more prefetch run on the node than its slots.

Through the engine's own registry, queue and ``Names.delete``: no daemon can hold a
staging two users share stalled here (a download is keyed per user; a shared source
is a tree, copied at once)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from stager.core.durable import CrashPoints
from stager.core.identity import Caller
from stager.core.metrics import Metrics
from stager.core.settings import Settings
from stager.engine.admission import PREFETCH_HOLDER, PREFETCHING
from stager.engine.lifecycle import Registry, Trash
from stager.engine.names import Names
from stager.engine.scheduler import Engine
from stager.ops import table
from stager.request import preflight
from stager.state.dataset import Entry, Handle
from stager.state.store import Store
from stager.wire.schemas import LeaseCreate, State

BOB, ALICE = 2001, 2002


def one_slot_engine(tmp_path: Path) -> tuple[Engine, Store]:
    """An engine on a cache in ``tmp_path`` with one prefetch slot, its registry bound
    (as its start binds it), and the store to close."""
    settings = Settings(
        cache_dir=tmp_path / "cache", runtime_dir=tmp_path / "run", prefetch_max_running=1
    )
    preflight.ensure_dirs(settings)
    store = Store(settings.db_path, table.load())
    trash = Trash(settings.partial_dir, lambda coro, name: coro.close())
    engine = Engine(settings, Metrics())
    engine.registry = Registry(settings, store, Metrics(), trash, CrashPoints(None))
    engine.admission.bind(engine.registry, engine._held, engine._exporting)
    return engine, store


def test_a_request_that_joined_a_running_prefetch_and_left_gives_its_slot_back(
    tmp_path: Path,
) -> None:
    engine, store = one_slot_engine(tmp_path)
    reg, queue = engine.reg, engine.admission.queue

    async def run() -> tuple[bool, bool, bool]:
        # bob's prefetch: queued low, handed out in the one slot, staging.
        shared = Entry(key="s" * 24, spec={}, steps=[], verify="size", state=State.QUEUED)
        await reg.queue(shared)
        token = PREFETCHING.set(True)
        queue.put(shared.key, BOB)
        PREFETCHING.reset(token)
        assert await asyncio.wait_for(queue.get(), 1) == (shared.key, BOB)
        reg.begin(shared)
        his = Handle(name="prefetch-92-p", key=shared.key, spec_key="s", owner=BOB)
        await reg.name(his)
        await reg.lease(his, LeaseCreate(holder=f"{PREFETCH_HOLDER}92"))
        # alice's request joins it (a request's join: the slot is free).
        await reg.name(Handle(name="same", key=shared.key, spec_key="s", owner=ALICE))
        queue.joined(shared.key)
        # alice's own prefetch of other data, queued low.
        other = Entry(key="o" * 24, spec={}, steps=[], verify="size", state=State.QUEUED)
        await reg.queue(other)
        token = PREFETCHING.set(True)
        queue.put(other.key, ALICE)
        PREFETCHING.reset(token)
        while_joined = await handed_within(queue, 0.2)
        queue.ended(other.key)  # (as if it staged and ended) and asked for again
        queue.put(other.key, ALICE, low=True)
        # She leaves: the staging is bob's prefetch's alone, in the slot again.
        await Names(engine).delete("same", Caller(uid=ALICE, gid=ALICE))
        after_leave = await handed_within(queue, 0.2)
        queue.ended(shared.key)  # bob's staging ends: the slot is free
        after_end = await handed_within(queue, 1)
        return while_joined, after_leave, after_end

    try:
        assert asyncio.run(run()) == (True, False, True)
    finally:
        store.close()


async def handed_within(queue, seconds: float) -> bool:  # noqa: ANN001 - FairQueue
    """Whether the queue hands out a staging within ``seconds``."""
    try:
        await asyncio.wait_for(queue.get(), seconds)
    except TimeoutError:
        return False
    return True


def test_a_request_that_joined_a_queued_prefetch_and_left_leaves_it_a_prefetch(
    tmp_path: Path,
) -> None:
    """The same join and leave while the prefetch still waits: the join made it a
    request's (it runs in its owner's turn, taking no prefetch slot); once the request's
    name is deleted it is the prefetches' alone, and waits for a prefetch slot again.
    Before, it stayed a request's: it ran past the node's prefetch slots, ahead of every
    other prefetch."""
    engine, store = one_slot_engine(tmp_path)
    reg, queue = engine.reg, engine.admission.queue

    async def prefetch(key: str, job: int) -> Entry:
        entry = Entry(key=key, spec={}, steps=[], verify="size", state=State.QUEUED)
        await reg.queue(entry)
        token = PREFETCHING.set(True)
        queue.put(key, BOB)
        PREFETCHING.reset(token)
        his = Handle(name=f"prefetch-{job}-p", key=key, spec_key=key[0], owner=BOB)
        await reg.name(his)
        await reg.lease(his, LeaseCreate(holder=f"{PREFETCH_HOLDER}{job}"))
        return entry

    async def run() -> bool:
        # bob's first prefetch runs, in the one slot; his second waits for it.
        running = await prefetch("r" * 24, 92)
        assert await asyncio.wait_for(queue.get(), 1) == (running.key, BOB)
        reg.begin(running)
        waiting = await prefetch("w" * 24, 93)
        # alice's request joins the waiting one, then she deletes her name.
        await reg.name(Handle(name="same", key=waiting.key, spec_key="w", owner=ALICE))
        queue.put(waiting.key, ALICE)
        await Names(engine).delete("same", Caller(uid=ALICE, gid=ALICE))
        after_leave = await handed_within(queue, 0.2)
        queue.ended(running.key)  # the first ends: the slot is the waiting one's
        return after_leave, await handed_within(queue, 1)

    try:
        assert asyncio.run(run()) == (False, True), "it ran past the node's one slot, or never"
    finally:
        store.close()
