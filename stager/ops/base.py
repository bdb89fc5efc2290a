"""What every operation is given and may use: its request fields, where to write,
how to report, when to stop, and where it may read from.

An op is a pair of plain blocking functions, declared in :mod:`stager.ops.table`:

- ``check(step, CheckContext) -> int`` runs when the request arrives (fast: stat
  calls, one archive header); it refuses bad input with a sentence and returns the
  bytes the op expects to write.
- ``run(step, OpContext)`` runs in the staging process (:mod:`stager.staging.worker`).
  It is idempotent: a resumed staging re-runs its unfinished step in the same partial
  folder, so an op skips work already complete and overwrites the rest. It may return
  the bytes it put in the tree when it knows them exactly, which a one-step staging
  takes as its size instead of measuring the tree; ``None``: the staging measures.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Annotated, Protocol

from pydantic import AfterValidator, BaseModel, ConfigDict

from stager.core.errors import Cancelled, SourceNotFound, UnsafePath
from stager.wire.progress import ProgressSink
from stager.wire.schemas import checked_path


class StepParams(BaseModel):
    """An op's request fields. The op table adds the ``op`` name that selects it."""

    model_config = ConfigDict(extra="forbid")


def _absolute_source(value: str) -> str:
    if not value.startswith("/"):
        raise ValueError(f"source {value!r} must be an absolute path")
    return checked_path(value)


def source_or_inside(value: str) -> str:
    """An absolute source, or a path an earlier step wrote inside the dataset."""
    return _absolute_source(value) if value.startswith("/") else _relative(value)


def _relative(value: str) -> str:
    path = PurePosixPath(value)
    if path.is_absolute() or ".." in path.parts:
        raise ValueError(f"path {value!r} must be relative to the dataset directory, without '..'")
    return checked_path(value)


AbsoluteSource = Annotated[str, AfterValidator(_absolute_source)]
# ``fetch`` then ``extract`` of what it fetched: a relative ``src`` names an earlier
# step's output inside the dataset (see ``OpContext.source``).
SourceOrInside = Annotated[str, AfterValidator(source_or_inside)]
RelativePath = Annotated[str, AfterValidator(_relative)]


class CancelSignal(Protocol):
    """A ``threading.Event``-like flag: a cancel request or the daemon stopping."""

    def is_set(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> bool: ...


@dataclass(frozen=True)
class CheckContext:
    """What ``check`` may consult when a request arrives."""

    # Sources must lie under one of these (empty: anywhere the daemon can read).
    allowed_roots: tuple[Path, ...] = ()
    verify: str = "size"  # the request's level, for ops whose refusal depends on the step


@dataclass
class OpContext:
    root: Path  # the dataset's partial directory; every destination is inside it
    progress: ProgressSink
    cancel: CancelSignal = field(default_factory=threading.Event)
    workers: int = 4  # parallelism an op may use for its own work (threads or processes)
    verify: str = "size"  # size | sha256 | none; the op table says which ops honour which
    allowed_roots: tuple[Path, ...] = ()  # as in CheckContext

    @property
    def check_context(self) -> CheckContext:
        """For ops whose ``run`` repeats their ``check``."""
        return CheckContext(allowed_roots=self.allowed_roots, verify=self.verify)

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

    def source(self, path: str) -> str:
        """A step's ``src``: absolute as given, or an earlier step's output in the dataset."""
        if path.startswith("/"):
            return path
        inside = self.destination(path)
        if not os.path.lexists(inside):
            raise SourceNotFound(
                f"{path!r} is not in the dataset; a relative src names a file an earlier "
                "step wrote (a fetch, a copy), so put that step first"
            )
        return str(inside)


def make_dir(path: str) -> None:
    """mkdir that replaces a file or link an earlier run left where a directory belongs."""
    try:
        os.mkdir(path)
    except FileExistsError:
        if os.path.isdir(path) and not os.path.islink(path):
            return
        os.unlink(path)
        os.mkdir(path)


@dataclass(frozen=True)
class ImageStream:
    """What a step makes, as an archive that image mode reads straight into the image
    (stager.kinds.imaging) instead of writing its files: ``src`` (absolute: a source; relative:
    an earlier step's output, used up unless ``keep``), its members with ``strip``
    leading components dropped, under ``dst``; ``nested``: the archives inside it too.
    ``before`` runs first, in the staging (an md5 check of the archive)."""

    src: str
    dst: str = "."
    strip: int = 0
    nested: bool = False
    format: str = "auto"
    keep: bool = False
    before: Callable[[OpContext], None] | None = None
