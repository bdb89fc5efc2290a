"""A download slower than a floor is stalled: fewer than ``min_download_rate`` bytes a
second over the last ``download_rate_window_s`` fails its staging (the stall timeout
sees only counters that stand still, which a trickling server keeps moving: the story
is docs/multiuser.md's).

Timed from the step's first counted bytes (before them, a resumed ``.part``'s sha256
or a slow server is bounded by other timeouts). A download extracted as it arrives
counts its bytes twice, so its floor is in effect half.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

from stager.core.redact import redact_url


class DownloadRateFloor:
    """Fed the staging's step and byte counter at each look; says when the download
    under way has brought too few bytes over the last window."""

    def __init__(
        self, steps: Sequence[dict[str, Any]], min_bytes_per_s: int, window_s: float
    ) -> None:
        self._steps = steps
        self._min = min_bytes_per_s
        self._window_s = window_s
        self._step = 0
        self._bytes_at_step = 0
        self._since: float | None = None  # the step's first counted bytes
        self._samples: deque[tuple[float, int]] = deque()

    def check(self, now: float, step_index: int, bytes_done: int) -> str | None:
        """None, or the sentence that fails the staging."""
        if step_index != self._step:
            self._step, self._bytes_at_step = step_index, bytes_done
            self._since = None
            self._samples.clear()
        url = self._url(step_index)
        if url is None:
            return None
        if self._since is None:
            if bytes_done == self._bytes_at_step:
                return None  # nothing has arrived yet
            self._since = now
        self._samples.append((now, bytes_done))
        # Keep the newest sample at least a window old: the bytes then, to count from.
        start = now - self._window_s
        while len(self._samples) > 1 and self._samples[1][0] <= start:
            self._samples.popleft()
        if now - self._since < self._window_s:
            return None
        brought = bytes_done - self._samples[0][1]
        if brought >= self._min * self._window_s:
            return None
        return (
            f"downloading {redact_url(url)} (step {step_index}) brought {brought} bytes in the "
            f"last {self._window_s:g} s, below the minimum of {self._min} bytes/s "
            "(--min-download-rate); check the server and the network, then stage again, or "
            "lower --min-download-rate (0: no minimum) or lengthen --download-rate-window"
        )

    def _url(self, step_index: int) -> str | None:
        if not self._min or not 0 < step_index <= len(self._steps):
            return None
        url = self._steps[step_index - 1].get("url")
        return url if isinstance(url, str) else None
