"""Every durable step of an entry's life, in order, and a way to crash right after one.

:mod:`stager.engine.lifecycle` makes these changes (the staging process four of them).
The crash-consistency tests iterate ``Durable``, so a new step is tested by itself.

``settings.crash_after`` names a member of ``Durable``, ``#N`` for its N-th time, and
``@K`` for the K-th staging process (e.g. ``"step-done#2@1"``): at that point the
daemon dies as ``kill -9`` would have it (from a staging process, its daemon first).
``"trace"`` prints every point reached to stderr (``stager durable: NAME pid=PID``).
Unset, ``reached`` is a comparison and nothing more.
"""

from __future__ import annotations

import os
import signal
import sys
from enum import StrEnum


class Durable(StrEnum):
    """Every durable step of an entry's life, in order. After a crash right after any
    of them, a restart plus any request yields a complete dataset or a clear failure."""

    # A request arrives.
    QUEUED = "queued"  # store: the entry, queued
    TOUCHED = "touched"  # store: the entry's last use (LRU order), on a hit or a lease
    NAMED = "named"  # store: the request's name for it
    LEASED = "leased"  # store: a lease on it
    # An attempt stages it.
    STAGING = "staging"  # store: staging, with the attempt's id
    ATTEMPT_CREATED = "attempt-created"  # fs: partial/<key>.<attempt>/tree (staging process)
    STEP_DONE = "step-done"  # fs: steps-done marker, once per step (staging process)
    INPUT_USED_UP = "input-used-up"  # fs: an extracted intermediate archive set aside (ditto)
    IMAGE_BUILT = "image-built"  # fs: partial/<key>.<attempt>/image.erofs complete (ditto)
    DELIVERY_REMOVED = "delivery-removed"  # fs: a broadcast copy it adopted, removed
    # ... and publishes it (``Registry.publish``).
    PUBLISHED = "published"  # fs: tree renamed to data/<key>, the folder fsynced
    IMAGE_PUBLISHED = "image-published"  # fs: image renamed to data/<key>.erofs, fsynced
    MOUNTED = "mounted"  # mount: the image mounted read-only at data/<key>
    LINKED = "linked"  # fs: each name's link points at data/<key>
    READY = "ready"  # store: ready
    ATTEMPT_REMOVED = "attempt-removed"  # fs: the attempt's folder (its marker) removed
    # ... or it ends otherwise.
    ATTEMPT_DISCARDED = "attempt-discarded"  # fs: the attempt's folder renamed aside
    ENDED = "ended"  # store: failed or cancelled
    # Ready data leaves the cache.
    EVICTED = "evicted"  # store: evicted
    UNLINKED = "unlinked"  # fs: links to it removed
    UNMOUNTED = "unmounted"  # mount: data/<key> unmounted (an image)
    IMAGE_DELETED = "image-deleted"  # fs: data/<key>.erofs and its mount point removed
    DATA_DISCARDED = "data-discarded"  # fs: data/<key> renamed aside
    # Names and leases end.
    RELEASED = "released"  # store: a lease removed
    FORGOTTEN = "forgotten"  # store: a name removed


class CrashPoints:
    def __init__(self, crash_after: str | None, daemon_pid: int | None = None) -> None:
        spec, _, staging = (crash_after or "").partition("@")
        point, _, nth = spec.partition("#")
        self.point = point or None
        self.nth = int(nth or 1)
        self.staging = int(staging) if staging else None  # which staging process, if any
        self.daemon_pid = daemon_pid or os.getpid()
        self.seen = 0
        self.stagings = 0

    def for_staging_process(self) -> str | None:
        """The setting the next staging process gets: the point, if it is the one meant."""
        self.stagings += 1
        if self.point == "trace":
            return "trace"
        if self.staging is not None and self.staging == self.stagings:
            return f"{self.point}#{self.nth}"
        return None

    def reached(self, point: Durable) -> None:
        """Called right after ``point`` became durable."""
        if self.point == "trace":
            print(f"stager durable: {point} pid={os.getpid()}", file=sys.stderr, flush=True)
            return
        if point != self.point or (self.staging is not None and os.getpid() == self.daemon_pid):
            return
        self.seen += 1
        if self.seen == self.nth:
            if self.daemon_pid != os.getpid():
                os.kill(self.daemon_pid, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
