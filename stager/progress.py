"""Progress of one staging: counters fed by worker threads, rate and ETA derived.

Modelled on rich's progress ``Task``: samples of (time, bytes_done) in a sliding
window give the rate; the clock is injected so tests drive time by hand.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from stager.schemas import ProgressPublic

Clock = Callable[[], float]


class Progress:
    """Thread-safe counters for one dataset; ``snapshot()`` is what the API shows."""

    def __init__(self, steps_total: int = 0, clock: Clock = time.monotonic, window_s: float = 5.0):
        self._clock = clock
        self._window_s = window_s
        self._lock = threading.Lock()
        self._samples: deque[tuple[float, int]] = deque()
        self.step: str | None = None
        self.step_index = 0
        self.steps_total = steps_total
        self.bytes_done = 0
        self.bytes_total = 0
        self.files_done = 0
        self.files_total: int | None = None

    def start_step(self, name: str, index: int) -> None:
        with self._lock:
            self.step = name
            self.step_index = index

    def add_total(self, nbytes: int = 0, files: int = 0) -> None:
        """Grow the known amount of work; ops call this as they discover it."""
        with self._lock:
            self.bytes_total += nbytes
            if files:
                self.files_total = (self.files_total or 0) + files

    def advance(self, nbytes: int = 0, files: int = 0) -> None:
        with self._lock:
            self.bytes_done += nbytes
            self.files_done += files
            self._sample()

    def mirror(
        self,
        step_index: int,
        step: str | None,
        bytes_total: int,
        files_total: int | None,
        bytes_done: int,
        files_done: int,
    ) -> None:
        """Take absolute counters reported by a staging process."""
        with self._lock:
            self.step_index, self.step = step_index, step
            self.bytes_total, self.files_total = bytes_total, files_total
            changed = bytes_done != self.bytes_done
            self.bytes_done, self.files_done = bytes_done, files_done
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
    def restore(cls, public: ProgressPublic, clock: Clock = time.monotonic) -> Progress:
        """Rebuild counters from a stored snapshot (after a daemon restart)."""
        progress = cls(steps_total=public.steps_total, clock=clock)
        progress.step, progress.step_index = public.step, public.step_index
        progress.bytes_total, progress.files_total = public.bytes_total, public.files_total
        progress.bytes_done, progress.files_done = public.bytes_done, public.files_done
        return progress
