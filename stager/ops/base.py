"""What every operation receives: where to write, how to report, when to stop.

An op is a plain blocking function ``run(step, ctx)``; the engine calls it on a
worker thread. Ops must be idempotent and restartable: after a crash the engine
re-runs every step of an interrupted dataset in the same partial directory, so
an op skips work that is already complete (same size and mtime) and overwrites
anything else.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

from stager.errors import Cancelled, SourceNotFound, SourceUnreadable, UnsafePath
from stager.progress import Progress


@dataclass
class OpContext:
    root: Path  # the dataset's partial directory; every destination is inside it
    progress: Progress
    cancel: threading.Event = field(default_factory=threading.Event)
    workers: int = 4  # threads an op may use for its own parallel work
    verify: str = "size"  # size | sha256 | none

    def check_cancelled(self) -> None:
        """Called by ops between units of work so cancel and shutdown are prompt."""
        if self.cancel.is_set():
            raise Cancelled("staging was cancelled")

    def destination(self, relative: str) -> Path:
        """Resolve a step's relative destination, refusing anything outside the root."""
        target = (self.root / relative).resolve()
        root = self.root.resolve()
        if target != root and root not in target.parents:
            raise UnsafePath(
                f"destination {relative!r} resolves outside the dataset directory; "
                "use a path relative to the dataset root without '..' or links out of it"
            )
        return target


def require_source(path: str, what: str = "source") -> Path:
    """Fail with a sentence naming the path when a source is missing or unreadable."""
    source = Path(path)
    if not source.exists():
        raise SourceNotFound(f"{what} {path} does not exist; check the path in the request")
    if not os.access(source, os.R_OK):
        raise SourceUnreadable(
            f"{what} {path} is not readable by the daemon's user; fix its permissions"
        )
    return source


def make_dir(path: str) -> None:
    """mkdir that replaces a file or link an earlier run left where a directory belongs."""
    try:
        os.mkdir(path)
    except FileExistsError:
        if os.path.isdir(path) and not os.path.islink(path):
            return
        os.unlink(path)
        os.mkdir(path)
