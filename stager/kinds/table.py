"""The kinds' table: one row per kind, the only place that names them.

A request is of the first kind that it asks for (``Kind.asked``), an entry of the
first that holds its spec (``Kind.holds``): the tree, last, takes whatever no other
kind does. A new kind is a module of this package and one row here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from stager.core.settings import Settings
from stager.kinds.base import Kind
from stager.kinds.image import Image
from stager.kinds.squash import Squash
from stager.kinds.tree import Tree
from stager.state.dataset import Entry
from stager.wire.schemas import DatasetCreate

ROWS: tuple[Callable[[Settings], Kind], ...] = (Squash, Image, Tree)


class Kinds:
    """This daemon's kinds, each made once (a kind keeps what it watches: a tree's
    inotify, an image's mounts) and closed at the stop."""

    def __init__(self, settings: Settings) -> None:
        self.all: tuple[Kind, ...] = tuple(row(settings) for row in ROWS)

    def asked(self, request: DatasetCreate, steps: list[Any], ops: Any) -> Kind:
        return next(kind for kind in self.all if kind.asked(request, steps, ops))

    def of(self, entry: Entry) -> Kind:
        return self.of_spec(entry.spec)

    def of_spec(self, spec: dict[str, Any]) -> Kind:
        return next(kind for kind in self.all if kind.holds(spec))

    def mounted(self, entry: Entry) -> bool:
        """Whether ``entry``'s place is a mount (stager.state.layout)."""
        return self.of(entry).mounted

    def close(self) -> None:
        for kind in self.all:
            kind.close()
