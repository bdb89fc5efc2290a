"""The tree kind: a dataset as the folder its steps leave, sealed read-only.

Published by one rename of the attempt's tree to ``data/<key>`` (the commit point);
a hit checks its seal (stager.fs.seal), or nothing while inotify reports no change
(stager.fs.watch); an eviction moves it aside in one rename and deletes it in the
background.
"""

from __future__ import annotations

import asyncio
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stager.core.durable import Durable
from stager.core.settings import Settings
from stager.fs.deletion import delete_tree
from stager.fs.durable_names import rename_durably
from stager.fs.seal import Seal, check_seal, protect_top, seal_listed, seal_tree
from stager.fs.watch import TreeWatch
from stager.kinds.base import Kind, Shelf
from stager.staging.blocking import run_io
from stager.staging.publish import Attempt
from stager.staging.worker import Steps
from stager.state.cache import private_owner
from stager.state.dataset import Entry
from stager.wire.schemas import DatasetCreate, State


@dataclass(frozen=True)
class TreeStaging:
    """A tree's part of a staging job (stager.staging.worker.KindStaging): the steps' tree,
    sealed."""

    workers: int

    def published(self, final: Path, attempt: Attempt) -> Seal | None:
        if attempt.tree.is_dir():
            return None
        return seal_tree(final, self.workers)  # published just before the daemon died

    def built(self, attempt: Attempt) -> bool:
        return False

    def stage(self, staging: Steps) -> Seal:
        made, paired = staging.run()
        staging.ctx.check_cancelled()
        tree = staging.attempt.tree
        if staging.fresh and made is not None and _sealed_by_listing(staging, paired):
            return seal_listed(tree, made)
        return seal_tree(tree, self.workers)


def _sealed_by_listing(staging: Steps, paired: bool) -> bool:
    """Whether a fresh tree (not resumed) holds only what its last op made, files
    created read-only and counted (``read_only_files``), so that a listing seals it: the
    op is the only step, or ran as a pair with the download it used up."""
    ops, steps = staging.ops, staging.steps
    if not ops.op_of(steps[-1]).read_only_files:
        return False
    if len(steps) == 1:
        return True
    return len(steps) == 2 and paired and ops.used_up(steps[1], staging.ctx) is not None


class Tree(Kind):
    name = "tree"

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        # Published trees known unchanged since their last full check, without a walk.
        self._watch = TreeWatch()

    def asked(self, request: DatasetCreate, steps: list[Any], ops: Any) -> bool:
        return True  # what every request is unless it asks for another kind

    def holds(self, spec: dict[str, Any]) -> bool:
        return True

    def job(self, entry: Entry) -> TreeStaging:
        return TreeStaging(self.settings.op_workers)

    async def publish(self, entry: Entry, outcome: Seal, shelf: Shelf) -> None:
        """STAGING -> READY, in order: the attempt's tree renamed to ``data/<key>`` (the
        commit point; already done if the daemon died right after it), its top made
        read-only; every name's link, so whoever "ready" wakes can use it; the store's
        "ready"; the attempt's folder (its marker, inputs set aside) removed."""
        attempt, final = shelf.attempt(entry), shelf.final(entry)
        if await run_io(attempt.tree.is_dir):
            await run_io(shelf.layout.prepare, entry)  # a user's own copy: its gate
            await shelf.durable(Durable.PUBLISHED, rename_durably, attempt.tree, final)
        # Again after a crash: it changes nothing then.
        await run_io(protect_top, final, private_owner(entry))
        await shelf.made_ready(entry, outcome.nbytes, outcome)
        await shelf.durable(Durable.ATTEMPT_REMOVED, delete_tree, attempt.root, threading.Event())

    async def changed(
        self, entry: Entry, shelf: Shelf, lock: asyncio.Lock, walker: Any
    ) -> str | None:
        """Its seal checked by the walker process, or nothing: checked whole once, and
        no change reported since (stager.fs.watch)."""
        final = shelf.final(entry)
        if await run_io(self._watch.clean, entry.key, final):
            return None
        if entry.seal is None:
            changed: str | None = f"{final} has no seal to check (published by an older stager)"
        else:
            token = await run_io(self._watch.arm, entry.key, final)
            changed = await walker(
                check_seal, final, entry.seal, private_owner(entry), self.settings.op_workers
            )
            if changed is None:
                self._watch.confirm(entry.key, token)
        if changed is not None:
            self._watch.forget(entry.key)
        return changed

    async def recover(self, entry: Entry, shelf: Shelf) -> bool:
        """Published before a crash, its store not yet "ready": published again, sealed
        anew on this process alone (workers=1: no fork from the daemon)."""
        if not (entry.active and entry.attempt and await run_io(self._published, entry, shelf)):
            return False
        if entry.state == State.QUEUED:
            entry.move(State.STAGING)
        await self.publish(entry, await run_io(seal_tree, shelf.final(entry), 1), shelf)
        return True

    @staticmethod
    def _published(entry: Entry, shelf: Shelf) -> bool:
        """Whether this entry's attempt got past its commit point (see ``publish``)."""
        attempt = shelf.attempt(entry)
        done = attempt.steps_done() == len(entry.steps)
        return done and not attempt.tree.exists() and shelf.final(entry).is_dir()

    async def move(self, entry: Entry, old: Path, shelf: Shelf) -> bool:
        """A tree an earlier release published at ``data/<key>``: renamed behind its gate
        (a crash after the rename finds it there, and nothing at ``old``)."""
        return await run_io(self._move, entry, old, shelf)

    @staticmethod
    def _move(entry: Entry, old: Path, shelf: Shelf) -> bool:
        final = shelf.final(entry)
        if not old.is_dir() or os.path.ismount(old) or os.path.lexists(final):
            return False
        shelf.layout.prepare(entry)
        rename_durably(old, final)
        return True

    async def delete(self, entry: Entry, shelf: Shelf) -> None:
        """Moved aside in one rename, deleted in the background; a user's own copy with
        its gate (stager.state.layout), so nothing of it is left under ``data/``."""
        seal = entry.seal
        dataset = (entry.key, private_owner(entry))
        discarded = await shelf.trash.discard(
            shelf.layout.top(entry), entry.size_bytes, dataset, seal.entries if seal else 0
        )
        if discarded:
            shelf.crash.reached(Durable.DATA_DISCARDED)

    def close(self) -> None:
        self._watch.close()
