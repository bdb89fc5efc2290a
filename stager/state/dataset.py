"""Cache entries (what is staged, by the key of the request's spec) and handles (users'
names for entries: two names asking for identical content share one entry); their
transitions (``ALLOWED``) are made by :mod:`stager.engine.lifecycle` only.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from stager.core.errors import StagerError
from stager.core.redact import redact_text
from stager.fs.credentials import Reader
from stager.fs.seal import Seal
from stager.image.published import ImageRecord
from stager.wire.progress import Progress
from stager.wire.schemas import (
    DatasetPublic,
    ErrorInfo,
    ImagePublic,
    LeasePublic,
    Origin,
    State,
    TorchvisionUsage,
)

CANCELLED_BY_REQUEST = ErrorInfo(type="cancelled", message="staging was cancelled by a request")

ALLOWED = {
    State.QUEUED: {State.STAGING, State.CANCELLED, State.FAILED},
    State.STAGING: {State.READY, State.FAILED, State.CANCELLED, State.QUEUED},
    State.READY: {State.EVICTED},
    State.FAILED: {State.QUEUED},
    State.CANCELLED: {State.QUEUED},
    State.EVICTED: {State.QUEUED},
}


def now() -> datetime:
    return datetime.now(UTC)


def spec_key(spec: dict[str, Any]) -> str:
    """Stable key of a spec: the same request maps to the same cache entry across restarts."""
    canonical = json.dumps(spec, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:24]


def private_key(key: str, uid: int) -> str:
    """The key of one user's own copy of what ``key`` names, in the node service: data
    that not everyone may read is never found under another user's request."""
    return spec_key({"key": key, "private_to": uid})


class IllegalTransition(StagerError):
    type = "internal_error"


@dataclass
class Entry:
    key: str
    spec: dict[str, Any]
    steps: list[Any]  # validated Step models
    verify: str
    state: State = State.QUEUED
    error: ErrorInfo | None = None
    progress: Progress = field(default_factory=Progress)
    usage: list[dict[str, Any]] = field(default_factory=list)  # from the recipe
    attempt: str | None = None  # the staging attempt that owns partial/<key>.<attempt>
    # How the data arrives: {"how": "staged" | "broadcast", "node": ..., "job": ...}.
    origin: dict[str, Any] | None = None
    # A broadcast delivery this staging reads (its folder goes when the staging ends);
    # not persisted: a restart deletes deliveries, and ends the adoption (lifecycle.DELIVERY_LOST).
    delivery: str | None = None
    size_bytes: int = 0
    estimate_bytes: int = 0
    # What the published tree must still be (stager.fs.seal); a hit checks it.
    seal: Seal | None = None
    # An image dataset's published image (stager.image.published); a hit checks it.
    image: ImageRecord | None = None
    # Whose rights its sources are read with (node service only; None: the daemon's).
    reader: Reader | None = None
    created_at: datetime = field(default_factory=now)
    updated_at: datetime = field(default_factory=now)
    last_used_at: datetime = field(default_factory=now)  # LRU order for eviction
    # Set to stop the running ops: by a cancel request or by daemon shutdown.
    cancel: threading.Event = field(default_factory=threading.Event, repr=False)

    def move(self, new: State, error: ErrorInfo | None = None) -> None:
        if new not in ALLOWED[self.state]:
            raise IllegalTransition(f"dataset {self.key} cannot go from {self.state} to {new}")
        self.state = new
        self.error = error
        self.updated_at = now()

    @property
    def step_names(self) -> list[str]:
        return [step.op for step in self.steps]

    @property
    def active(self) -> bool:
        return self.state in (State.QUEUED, State.STAGING)

    @property
    def live(self) -> bool:
        """Queued, staging or ready: a request for it joins or hits."""
        return self.state in (State.QUEUED, State.STAGING, State.READY)


@dataclass(frozen=True)
class Ask:
    """What a request asks of an entry it (re)starts, set on it by ``Registry.queue``."""

    steps: list[Any]
    verify: str
    usage: list[dict[str, Any]] = field(default_factory=list)
    origin: dict[str, Any] | None = None
    delivery: str | None = None
    estimate_bytes: int = 0
    reader: Reader | None = None
    # Who asked, as (owner uid, name), for the log's "queued" line: a new name is kept
    # only after its entry is queued.
    asked_as: tuple[int, str] | None = None

    @classmethod
    def again(cls, entry: Entry, reader: Reader, asked_as: tuple[int, str]) -> Ask:
        """What ``entry`` asked, asked again for a copy read with ``reader``'s rights."""
        return cls(entry.steps, entry.verify, entry.usage, entry.origin, None,
                   entry.estimate_bytes, reader, asked_as)  # fmt: skip


@dataclass
class Handle:
    name: str
    key: str  # the entry it shows: changes when the sources change
    spec_key: str  # the request without its sources' fingerprint: decides name conflicts
    # The uid whose name this is: every user has a namespace of their own, so alice's
    # "inat" and bob's "inat" are two handles (which may show one shared entry).
    owner: int
    link: str | None = None
    created_at: datetime = field(default_factory=now)
    hit: bool = False  # the latest request for this name found the data already cached
    # Its owner ended it (cancelled or evicted): the name shows that end whatever another
    # name makes of its entry, until its owner's next request for it.
    ended: State | None = None

    @property
    def id(self) -> tuple[int, str]:
        return (self.owner, self.name)


def _usage(raw: dict[str, Any], path: Path) -> TorchvisionUsage:
    usage = TorchvisionUsage.model_validate(raw)
    root = path / usage.root if usage.root not in ("", ".") else path
    args = "".join(f", {k}={v!r}" for k, v in usage.kwargs.items())
    usage.code = f"{usage.class_}(root={str(root)!r}{args})"
    return usage


def public_origin(
    entry: Entry | None, hit: bool = False, of_another: bool = False
) -> Origin | None:
    """How ``entry`` arrived; ``of_another``: staged for another user, whose job is not said."""
    if entry is None or not entry.origin:
        return None
    origin = {**entry.origin, "hit": hit}
    if of_another:
        origin["job"] = None
    return Origin.model_validate(origin)


def _staged_for_another(entry: Entry, handle: Handle) -> bool:
    return entry.reader is not None and entry.reader.uid != handle.owner


def _redacted(error: ErrorInfo | None) -> ErrorInfo | None:
    """Never a URL's token (stager.core.redact)."""
    if error is None:
        return None
    return ErrorInfo(type=error.type, message=redact_text(error.message))


def _image(entry: Entry, final: Path) -> ImagePublic | None:
    record = entry.image
    if record is None:
        return None
    suffix = ".sqfs" if record.format == "squashfs" else ".erofs"
    return ImagePublic(
        file=str(final.with_name(final.name + suffix)),  # beside its mount point
        format=record.format,  # type: ignore[arg-type]
        mount=record.mount,  # type: ignore[arg-type]
        size_bytes=record.identity.size,
        files=record.files,
        sha256=record.identity.sha256 or None,
    )


def public_view(
    handle: Handle, entry: Entry, final: Path, leases: list[LeasePublic]
) -> DatasetPublic:
    """What ``handle``'s owner is told of it; ``final``: where its entry lives (the path
    does not exist before the atomic publish, so nobody reads a half-staged tree)."""
    common: dict[str, Any] = dict(
        name=handle.name,
        owner=handle.owner,
        key=entry.key,
        path=str(final),
        link=handle.link,
        leases=leases,
        updated_at=entry.updated_at,
    )
    if handle.ended is not None and entry.state != handle.ended:
        # A name its owner ended: that end, whatever another name made of its entry since.
        return DatasetPublic(
            **common,
            state=handle.ended,
            progress=Progress(step_names=entry.step_names).snapshot(),
            error=CANCELLED_BY_REQUEST if handle.ended == State.CANCELLED else None,
            created_at=handle.created_at,
        )
    return DatasetPublic(
        **common,
        state=entry.state,
        progress=entry.progress.snapshot(),
        error=_redacted(entry.error),  # a failed download's sentence names its URL
        usage=[_usage(u, final) for u in entry.usage],
        size_bytes=entry.size_bytes,
        origin=public_origin(entry, handle.hit, of_another=_staged_for_another(entry, handle)),
        image=_image(entry, final) if entry.state == State.READY else None,
        created_at=min(handle.created_at, entry.created_at),
    )
