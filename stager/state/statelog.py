"""One log line per state change of a dataset, in words an admin can act on (the events
and what each says: docs/logging.md). A line names the dataset by its users' names and
owners (``'inat' of alice``) and its key; the JSON format carries the same as fields.
Reasons are redacted (a URL's token).
"""

from __future__ import annotations

import logging
import pwd
import time
from collections.abc import Callable
from functools import cache
from typing import Any

from stager.core.redact import redact_text
from stager.core.settings import format_size
from stager.state.dataset import Entry, Handle

log = logging.getLogger("stager.datasets")


@cache
def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


class StateLog:
    def __init__(self, handles_of: Callable[[str], list[Handle]]) -> None:
        self._handles_of = handles_of
        self._since: dict[str, float] = {}  # key -> when it was queued (monotonic)

    def _line(
        self,
        level: int,
        entry: Entry,
        event: str,
        detail: str,
        asked_as: tuple[int, str] | None = None,
        **fields: Any,
    ) -> None:
        handles = self._handles_of(entry.key)
        datasets = sorted(
            {(h.owner, h.name) for h in handles} | ({asked_as} if asked_as else set())
        )
        extra = {
            "event": event,
            "key": entry.key,
            "datasets": [{"name": n, "owner": user_name(o)} for o, n in datasets],
            **fields,
        }
        # ``dataset 'inat' of alice (key 3f2a…)``: every name an entry goes by.
        shown = ", ".join(f"{name!r} of {user_name(owner)}" for owner, name in datasets)
        plural = "datasets" if len(datasets) > 1 else "dataset"
        who = f"{plural} {shown} (key {entry.key})" if datasets else f"dataset with key {entry.key}"
        log.log(level, "%s %s%s", who, event, f": {detail}" if detail else "", extra=extra)

    def queued(self, entry: Entry, asked_as: tuple[int, str] | None) -> None:
        self._since[entry.key] = time.monotonic()
        size = format_size(entry.estimate_bytes)
        steps = ", ".join(entry.step_names) or "no steps"
        detail = f"{len(entry.steps)} step(s) ({steps}), about {size} to write"
        self._line(
            logging.INFO, entry, "queued", detail, asked_as, estimate_bytes=entry.estimate_bytes
        )

    def staging(self, entry: Entry, resumed: bool) -> None:
        detail = f"attempt {entry.attempt}" + (" resumed where it stopped" if resumed else "")
        self._line(logging.INFO, entry, "staging", detail, attempt=entry.attempt)

    def ready(self, entry: Entry) -> float | None:
        """Logs it; returns the seconds since it was queued (None: queued before a restart)."""
        seconds = self._seconds(entry)
        took = f"in {seconds:.1f} s, " if seconds is not None else ""
        detail = f"{took}{format_size(entry.size_bytes)}"
        self._line(
            logging.INFO,
            entry,
            "ready",
            detail,
            seconds=seconds,
            size_bytes=entry.size_bytes,
        )
        return seconds

    def ended(self, entry: Entry) -> None:
        """Failed or cancelled: the reason, as the user reads it."""
        self._since.pop(entry.key, None)
        reason = redact_text(entry.error.message) if entry.error else "no reason given"
        kind = entry.error.type if entry.error else None
        level = logging.INFO if entry.state == "cancelled" else logging.WARNING
        self._line(level, entry, str(entry.state), reason, reason=reason, error_type=kind)

    def interrupted(self, entry: Entry) -> None:
        self._line(
            logging.INFO, entry, "interrupted", "the daemon is stopping; resumes at the next start"
        )

    def resumed(self, entry: Entry) -> None:
        self._since[entry.key] = time.monotonic()
        self._line(logging.INFO, entry, "resumed", "interrupted by the last stop, queued again")

    def evicted(self, entry: Entry, why: str) -> None:
        detail = f"{why}; frees {format_size(entry.size_bytes)}"
        self._line(logging.INFO, entry, "evicted", detail, reason=why, size_bytes=entry.size_bytes)

    def _seconds(self, entry: Entry) -> float | None:
        since = self._since.pop(entry.key, None)
        return None if since is None else round(time.monotonic() - since, 3)
