"""What a dataset kind is: the protocol every kind keeps, and what it is handed.

A kind is what differs between datasets the engine, the registry, the staging process
and the fan-out otherwise treat alike: ``check``, ``job`` (a
``stager.staging.worker.KindStaging``), ``publish``, ``changed`` (a hit), ``recover``,
``settle``, ``claim`` (a start), ``delete`` and ``export``. The callers never ask
which kind they hold. Kinds receive the registry's and the engine's parts as the
small protocols below, so nothing here imports stager.engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

from stager.core.durable import CrashPoints, Durable
from stager.core.settings import Settings
from stager.engine.held_space import HeldSpace
from stager.fs.seal import Seal
from stager.image.published import ImageRecord
from stager.staging.publish import Attempt
from stager.state.dataset import Entry
from stager.state.layout import Layout
from stager.wire.schemas import DatasetCreate, ErrorInfo, ExportCreate, ExportPublic, State

# The staging process's outcome, as the kind's job returned it (a Seal, an ImageMade).
Outcome = Any
# A ready entry, unchanged since its publish, or the Conflict that says why not.
ReadyTree = Callable[[Entry], Awaitable[Path]]


class Trash(Protocol):
    held: HeldSpace

    async def discard(
        self,
        path: Path,
        nbytes: int = ...,
        dataset: tuple[str, int | None] | None = ...,
        entries: int = ...,
    ) -> bool: ...

    def spawn_io(self, fn: Callable[..., Any], *args: Any) -> None: ...


class Shelf(Protocol):
    """What a kind reads and does of the registry (stager.engine.lifecycle.Registry)."""

    settings: Settings
    trash: Trash
    crash: CrashPoints
    layout: Layout  # where each entry lives under data/, its folders made and removed

    def final(self, entry: Entry) -> Path: ...

    def attempt(self, entry: Entry) -> Attempt: ...

    def owner_of(self, key: str) -> int | None: ...

    def key_at(self, name: str) -> str: ...

    async def durable(self, point: Durable, write: Callable[..., Any], *args: Any) -> None: ...

    def set_image(self, entry: Entry, image: ImageRecord | None) -> None: ...

    async def made_ready(self, entry: Entry, size: int, seal: Seal | None) -> None: ...

    async def end(self, entry: Entry, state: State, error: ErrorInfo) -> None: ...

    async def evict(self, entry: Entry, why: str = ...) -> None: ...


class Sender(Protocol):
    """What a kind that goes to other nodes as one file asks of the fan-out room
    (stager.fanout.room.FanoutRoom): room for the copy, booked as an export of
    ``entry`` (never evicted while copied), and the service's word on its sha256."""

    async def send_file(
        self,
        entry: Entry,
        request: ExportCreate,
        owner: Any,
        size: int,
        copy: Callable[[Any], tuple[Path, int, str]],
    ) -> tuple[Path, int, str, str | None]: ...


class Kind(Protocol):
    """One kind of dataset (see the module's docstring); one row of kinds/table.py. A
    kind subclasses it, and keeps the defaults where it has nothing to do."""

    name: str
    # Whether its place under data/ is a mount, which the kernel's mount table lists to
    # every user: then even a user's own daemon names it opaquely (stager.state.layout).
    mounted: bool = False

    def asked(self, request: DatasetCreate, steps: list[Any], ops: Any) -> bool:
        """Whether ``request`` (expanded to ``steps``) asks for this kind."""
        return False

    def holds(self, spec: dict[str, Any]) -> bool:
        """Whether an entry of ``spec`` is of this kind."""
        return False

    def check(
        self, request: DatasetCreate, steps: list[Any], ops: Any
    ) -> tuple[DatasetCreate, str | None]:
        """The request as staged (another kind's, where this one falls back) and the
        sentence that says so; raises what this node cannot stage so."""
        return request, None

    def job(self, entry: Entry) -> Any:
        """What the staging process runs for ``entry``: picklable, a
        ``stager.staging.worker.KindStaging``; its outcome is what ``publish`` takes."""
        ...

    async def publish(self, entry: Entry, outcome: Outcome, shelf: Shelf) -> None:
        """STAGING -> READY, past the commit point (again after a crash); it ends with
        ``shelf.made_ready``."""
        ...

    async def changed(
        self, entry: Entry, shelf: Shelf, lock: asyncio.Lock, walker: Any
    ) -> str | None:
        """At a hit on a ready entry: why it may not be served as it is, or None."""
        ...

    async def recover(self, entry: Entry, shelf: Shelf) -> bool:
        """At start, an entry a crash or a reboot left: settled here (True), or left to
        the registry's common course (False)."""
        ...

    async def move(self, entry: Entry, old: Path, shelf: Shelf) -> bool:
        """At start, before ``recover``: a user's own copy that an earlier release
        published at ``old`` (``data/<key>``) moved to its place (``shelf.final``, its
        folders made by ``shelf.layout``) in one rename; whether there was one to move."""
        return False

    async def settle(self, entries: list[Entry], shelf: Shelf) -> None:
        """At start, once every entry is settled: what of this kind's no entry holds
        (its mounts) is taken down."""
        return None

    async def claim(self, orphan: Path, shelf: Shelf) -> bool:
        """At start, a path under ``data/`` that no entry holds (named ``<key>`` or
        ``<key>.<suffix>``): whether it is this kind's, dealt with here (else the
        registry discards it)."""
        return False

    async def delete(self, entry: Entry, shelf: Shelf) -> None:
        """An evicted entry's data leaves ``data/``."""
        ...

    async def export(
        self, entry: Entry, request: ExportCreate, owner: Any, ready: ReadyTree, room: Sender
    ) -> ExportPublic | None:
        """The first part of a fan-out's export, when this kind goes as one file; None:
        sent as a tree is, in parts with a manifest."""
        return None

    def close(self) -> None:
        """The daemon stops (called on a thread: it may block)."""
        return None
