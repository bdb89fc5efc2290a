"""The node service keeps this node's ``stg_`` features in Slurm: one per declared
dataset it holds ready, so that job_submit.lua's ``--prefer`` steers jobs declaring it
here. A request's ``#STAGER`` words name its feature only once they are checked to
declare that very request; features are bounded (``slurm_node_features_max``,
``slurm_node_features_per_user``), set again every ``slurm_node_features_period_s``
(Slurm forgets them at a reconfigure), and a failed scontrol never fails a request
(docs/prestaging.md, "Placement").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import time
from collections import Counter
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Any

from stager.core.identity import Caller
from stager.core.settings import Settings
from stager.prestage import write_private
from stager.prestage.placement import names, scontrol
from stager.staging.blocking import run_io
from stager.state.dataset import State
from stager.wire.schemas import DatasetCreate, DatasetPublic

log = logging.getLogger("stager.prestage.placement")

TICK_S = 1.0  # how soon a dataset's readiness or eviction reaches Slurm
KEPT = 1000  # names remembered, features or not (the most recently used)
UNTIMED = 0.0  # what ``save`` writes as each use's time, for the release before


@dataclass
class Use:
    """A feature's data; how recent its last use is, is its place in ``Placement.uses``."""

    key: str  # the cache entry the words led to
    uid: int  # whose request used it last


class Placement:
    def __init__(self, engine: Any, settings: Settings) -> None:
        self.engine = engine  # stager.engine.scheduler.Engine
        self.settings = settings
        self.enabled = settings.multi_user and settings.slurm_node_features
        self.uses: dict[str, Use] = {}  # feature -> its data, by recency
        self.applied: list[str] | None = None  # what Slurm was last made to hold
        self._dirty = False
        self._task: asyncio.Task[None] | None = None
        self._declarations: Any = None  # stager.prestage.plan.declared.Declarations, made on use

    async def start(self) -> None:
        if not self.enabled:
            return
        if shutil.which("scontrol") is None:
            log.warning("STAGER_SLURM_NODE_FEATURES is on, but there is no scontrol here")
            self.enabled = False
            return
        self.uses = await run_io(load, self.settings.features_path)
        self._task = asyncio.create_task(self._keep(), name="slurm-node-features")

    async def stop(self) -> None:
        # The features stay: the data stays on the disk, and a restarted service finds it.
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def requested(self, request: DatasetCreate, caller: Caller, view: DatasetPublic) -> None:
        """A request was answered with ``view``: its declared words name its data."""
        if not self.enabled or not request.declared:
            return
        feature = self._feature(request)
        if feature is None:
            log.info("uid %s sent #STAGER words that do not declare its request", caller.uid)
            return
        self.uses.pop(feature, None)  # to the end: the most recently used
        self.uses[feature] = Use(view.key, caller.uid)
        while len(self.uses) > KEPT:
            del self.uses[next(iter(self.uses))]
        self._dirty = True

    def _feature(self, request: DatasetCreate) -> str | None:
        # The planner's parse of a #STAGER line, imported only where placement is on:
        # it loads the client's parser (and the daemon needs it nowhere else).
        from stager.prestage.plan.declared import Declarations, encode

        words = request.declared or ""
        if len(words.splitlines()) != 1:
            # One #STAGER line's words, as the client sends them: more lines would each
            # be parsed (about 1 ms each, on the event loop) and could name a feature of
            # words no script's line holds.
            return None
        if self._declarations is None:
            self._declarations = Declarations()
        wanted, _why = self._declarations.parse(encode([words]))
        if len(wanted) != 1:
            return None
        body = wanted[0].request()
        try:
            declared = type(request).model_validate(body)
        except ValueError:
            return None
        if declared.spec() != request.spec():
            return None
        return names.feature(body["declared"])

    def wanted(self) -> list[str]:
        """The features this node should have now (forgetting data gone for good)."""
        entries = self.engine.registry.entries
        for feature, use in list(self.uses.items()):
            entry = entries.get(use.key)
            if entry is None or not entry.live:
                del self.uses[feature]
                self._dirty = True
        chosen: list[str] = []
        per_user: Counter[int] = Counter()
        for feature, use in reversed(self.uses.items()):  # the most recent first
            if len(chosen) >= self.settings.slurm_node_features_max:
                break
            if entries[use.key].state != State.READY:
                continue
            if per_user[use.uid] >= self.settings.slurm_node_features_per_user:
                continue
            per_user[use.uid] += 1
            chosen.append(feature)
        return sorted(chosen)

    async def _keep(self) -> None:
        node = self.settings.this_node()
        checked_at = -float("inf")
        while True:
            wanted = self.wanted()
            due = time.monotonic() - checked_at >= self.settings.slurm_node_features_period_s
            if due or wanted != self.applied:
                checked_at = time.monotonic()  # failed or not: retried at the next period
                try:
                    if await run_io(scontrol.apply, node, wanted):
                        log.info("node %s's stager features are now %s", node, wanted or "none")
                    self.applied = wanted
                except scontrol.ScontrolFailed as exc:
                    period = self.settings.slurm_node_features_period_s
                    log.warning("%s; tried again in %.0f s", exc.message, period)
                    self.applied = wanted  # not again before the period
            if self._dirty:
                self._dirty = False
                try:
                    await run_io(save, self.settings.features_path, self.uses)
                except OSError as exc:
                    log.warning("could not save %s: %s", self.settings.features_path, exc)
            await asyncio.sleep(TICK_S)


def load(path: Path) -> dict[str, Use]:
    """The saved uses, the least recent first (the file's order). Items past an entry's
    first two (the time of its use, which ``save`` writes for the release before) are
    ignored."""
    try:
        saved = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("%s unreadable (%s): the node's features start over", path, exc)
        return {}
    return {f: Use(*use[:2]) for f, use in saved.items() if names.PATTERN.fullmatch(f)}


def save(path: Path, uses: dict[str, Use]) -> None:
    """In order of use, the least recent first. Not fsynced: a lost file costs only the
    features until the data is asked for again."""
    # A third item, the time of use (0: nobody reads it): the release before built
    # Use(key, uid, used_at) from each entry, and the node service of an admin who rolls
    # back to it failed to start on an entry of two (tests/stager/test_placement_uses.py).
    saved = {f: [*astuple(use), UNTIMED] for f, use in uses.items()}
    write_private(path, json.dumps(saved), durable=False)
