"""Progress of one staging, from the op that does the work to the wire.

An op reports to a ``ProgressSink``; in the staging process that is
``WorkerCounters``, which adds into plain integers and publishes them to shared memory
(``SharedCounters``) at most every ``PUBLISH_S``, so a million files cost a million
additions, not a million trips across processes. The daemon's ``Progress`` derives
rate and ETA from them; ``ProgressPublic`` is what clients render as it is.
``step_index`` is 1-based while a step runs, 0 before the first.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from pydantic import BaseModel, Field

Clock = Callable[[], float]

# How often the staging process publishes its counters: the daemon samples them
# every 0.1 s, so publishing faster only costs the ops time.
PUBLISH_S = 0.05


class ProgressPublic(BaseModel):
    """A staging's progress as the API reports it."""

    step: str | None = Field(default=None, description="op name of the running step")
    step_index: int = Field(
        default=0,
        description="1-based position of the running step (1 while the first step runs); "
        "0 before the first step starts",
    )
    steps_total: int = 0
    bytes_done: int = 0
    bytes_total: int = 0
    files_done: int = 0
    files_total: int | None = Field(default=None, description="null while not yet known")
    rate_bytes_per_s: float = 0.0
    eta_s: float | None = None


class ProgressSink(Protocol):
    """What ops report to."""

    def add_total(self, nbytes: int = 0, files: int = 0) -> None:
        """Grow the known amount of work, as it is discovered."""

    def advance(self, nbytes: int = 0, files: int = 0) -> None:
        """Count work done."""


def report_written(sink: ProgressSink, nbytes: int, inodes: int = 0) -> None:
    """Count bytes and inodes an op has just left on the disk, where the sink keeps that
    count (a staging process's): a staging stops by it at its quota or the disk's floor."""
    wrote = getattr(sink, "wrote", None)
    if wrote is not None and (nbytes > 0 or inodes > 0):
        wrote(nbytes, inodes)


# Slots of the shared counters.
(_STEP, _BYTES_TOTAL, _FILES_TOTAL, _BYTES_DONE, _FILES_DONE, _HAS_FILES_TOTAL, _WRITTEN,
 _INODES) = range(8)  # fmt: skip
_SLOTS = 8


class SharedCounters:
    """Absolute counters of one staging in shared memory; picklable."""

    def __init__(self, context: Any = None) -> None:
        self._array = (context or multiprocessing).Array("q", _SLOTS)

    def write(self, values: list[int]) -> None:
        with self._array.get_lock():
            self._array[:] = values

    def read(self) -> list[int]:
        with self._array.get_lock():
            return list(self._array)


class WorkerCounters:
    """The staging process's ``ProgressSink``: local sums, published now and then."""

    def __init__(self, shared: SharedCounters, clock: Clock = time.monotonic) -> None:
        self._shared = shared
        self._clock = clock
        self._lock = threading.Lock()
        self._values = [0] * _SLOTS
        self._written_limit: tuple[int, Callable[[int], Exception]] | None = None
        self._inode_limit: tuple[int, Callable[[int], Exception]] | None = None
        self._published_at = 0.0

    def start_step(self, index: int) -> None:
        with self._lock:
            self._values[_STEP] = index
            self._publish()

    def add_total(self, nbytes: int = 0, files: int = 0) -> None:
        with self._lock:
            self._values[_BYTES_TOTAL] += nbytes
            if files:
                self._values[_FILES_TOTAL] += files
                self._values[_HAS_FILES_TOTAL] = 1
            self._maybe_publish()

    def wrote(self, nbytes: int, inodes: int = 0) -> None:
        """Past a limit of :meth:`limit_written`, its error is raised in the op that wrote."""
        with self._lock:
            self._values[_WRITTEN] += nbytes
            self._values[_INODES] += inodes
            written, made = self._values[_WRITTEN], self._values[_INODES]
            self._maybe_publish()
        if self._written_limit is not None and written > self._written_limit[0]:
            raise self._written_limit[1](written)
        if self._inode_limit is not None and made > self._inode_limit[0]:
            raise self._inode_limit[1](made)

    def limit_written(
        self,
        limit: int | None,
        error: Callable[[int], Exception],
        inodes: int | None = None,
        inode_error: Callable[[int], Exception] | None = None,
    ) -> None:
        """Stop the staging once it has left more than ``limit`` bytes, or made more
        than ``inodes`` inodes (None: no limit)."""
        self._written_limit = None if limit is None else (limit, error)
        self._inode_limit = None if inodes is None or inode_error is None else (inodes, inode_error)

    def advance(self, nbytes: int = 0, files: int = 0) -> None:
        with self._lock:
            self._values[_BYTES_DONE] += nbytes
            self._values[_FILES_DONE] += files
            self._maybe_publish()

    def flush(self) -> None:
        with self._lock:
            self._publish()

    def _maybe_publish(self) -> None:
        if self._clock() - self._published_at >= PUBLISH_S:
            self._publish()

    def _publish(self) -> None:
        self._shared.write(self._values)
        self._published_at = self._clock()


class Progress:
    """A dataset's progress in the daemon (and a ``ProgressSink`` for ops run in-process)."""

    def __init__(
        self,
        steps_total: int = 0,
        step_names: list[str] | None = None,
        clock: Clock = time.monotonic,
        window_s: float = 5.0,
    ):
        self._clock = clock
        self._window_s = window_s
        self._lock = threading.Lock()
        self._samples: deque[tuple[float, int]] = deque()
        self._step_names = step_names or []
        self.step: str | None = None
        self.step_index = 0
        self.steps_total = steps_total or len(self._step_names)
        self.bytes_done = 0
        self.bytes_total = 0
        self.files_done = 0
        self.files_total: int | None = None
        # What the staging has left in its tree so far (at least): bytes done for a copy
        # or a download, the files' bytes for an extraction (report_written).
        self.bytes_written = 0
        self.inodes_made = 0  # and the inodes it made (folders, files, links)

    def add_total(self, nbytes: int = 0, files: int = 0) -> None:
        with self._lock:
            self.bytes_total += nbytes
            if files:
                self.files_total = (self.files_total or 0) + files

    def advance(self, nbytes: int = 0, files: int = 0) -> None:
        with self._lock:
            self.bytes_done += nbytes
            self.files_done += files
            self._sample()

    def mirror(self, shared: SharedCounters) -> None:
        """Take the absolute counters a staging process published."""
        values = shared.read()
        with self._lock:
            index = values[_STEP]
            self.step_index = index
            if 0 < index <= len(self._step_names):
                self.step = self._step_names[index - 1]
            self.bytes_total = values[_BYTES_TOTAL]
            self.files_total = values[_FILES_TOTAL] if values[_HAS_FILES_TOTAL] else None
            changed = values[_BYTES_DONE] != self.bytes_done
            self.bytes_done, self.files_done = values[_BYTES_DONE], values[_FILES_DONE]
            self.bytes_written, self.inodes_made = values[_WRITTEN], values[_INODES]
            if changed or not self._samples:
                self._sample()

    def _sample(self) -> None:
        now = self._clock()
        self._samples.append((now, self.bytes_done))
        # Keep one sample older than the window so the rate spans the whole window.
        while len(self._samples) > 2 and now - self._samples[1][0] > self._window_s:
            self._samples.popleft()

    @property
    def rate(self) -> float:
        """Bytes per second over the sliding window (0.0 until two samples exist)."""
        with self._lock:
            return self._rate_locked()

    def _rate_locked(self) -> float:
        if len(self._samples) < 2:
            return 0.0
        (t0, b0), (t1, b1) = self._samples[0], self._samples[-1]
        # A stalled transfer must show its stall: measure up to now, not the last sample.
        elapsed = max(self._clock(), t1) - t0
        return (b1 - b0) / elapsed if elapsed > 0 else 0.0

    def snapshot(self) -> ProgressPublic:
        with self._lock:
            rate = self._rate_locked()
            remaining = self.bytes_total - self.bytes_done
            eta = remaining / rate if rate > 0 and self.bytes_total and remaining >= 0 else None
            return ProgressPublic(
                step=self.step,
                step_index=self.step_index,
                steps_total=self.steps_total,
                bytes_done=self.bytes_done,
                bytes_total=self.bytes_total,
                files_done=self.files_done,
                # Some ops cannot count files ahead (a streamed archive): a total smaller
                # than what is done is known to be incomplete, so it shows as unknown.
                files_total=self.files_total
                if self.files_total is None or self.files_total >= self.files_done
                else None,
                rate_bytes_per_s=round(rate, 1),
                eta_s=round(eta, 1) if eta is not None else None,
            )

    @classmethod
    def restore(
        cls, public: ProgressPublic, step_names: list[str], clock: Clock = time.monotonic
    ) -> Progress:
        """Rebuild counters from a stored snapshot (after a daemon restart)."""
        progress = cls(step_names=step_names, clock=clock)
        progress.step, progress.step_index = public.step, public.step_index
        progress.bytes_total, progress.files_total = public.bytes_total, public.files_total
        progress.bytes_done, progress.files_done = public.bytes_done, public.files_done
        return progress
