"""Throughput accounting and the rank-0 CSV / TensorBoard logs."""

from __future__ import annotations

import csv
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class Throughput:
    """Images per second per logging interval, and time spent waiting for data.

    ``clock`` is injectable so the arithmetic is testable without sleeping.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter, skip_first: bool = True):
        self.clock = clock
        self.skip_first = skip_first  # the first interval includes worker start-up
        self.rates: list[float] = []
        self.data_time = 0.0
        self.start = clock()
        self._mark = self.start
        self._images = 0
        self._intervals = 0
        self._total_images = 0

    def add_data_wait(self, seconds: float) -> None:
        self.data_time += seconds

    def add_images(self, n: int) -> None:
        self._images += n
        self._total_images += n

    def interval(self) -> float:
        """Close the current interval; return its img/s."""
        now = self.clock()
        rate = self._images / max(now - self._mark, 1e-9)
        self._intervals += 1
        if not (self.skip_first and self._intervals == 1):
            self.rates.append(rate)
        self._mark, self._images = now, 0
        return rate

    def summary(self) -> dict[str, float]:
        elapsed = max(self.clock() - self.start, 1e-9)
        # Too few intervals for statistics (short epoch): fall back to the epoch mean.
        rates = self.rates or [self._total_images / elapsed]
        mean = sum(rates) / len(rates) if rates else float("nan")
        var = sum((r - mean) ** 2 for r in rates) / (len(rates) - 1) if len(rates) > 1 else 0.0
        return {
            "img_s_mean": mean,
            "img_s_std": math.sqrt(var),
            "data_wait_pct": 100.0 * self.data_time / elapsed,
            "epoch_time_s": elapsed,
        }


class MetricsLog:
    """Appends rows to ``<dir>/<name>.csv`` and scalars to TensorBoard (rank 0 only)."""

    def __init__(self, directory: Path | None, tensorboard: bool) -> None:
        self.directory = Path(directory) if directory else None
        self.writer: Any = None
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            if tensorboard:
                try:
                    from torch.utils.tensorboard import SummaryWriter
                except ImportError as exc:  # tensorboard is an optional extra
                    log.warning("tensorboard unavailable (%s); CSV logs only", exc)
                else:
                    self.writer = SummaryWriter(str(self.directory / "tensorboard"))

    def row(self, name: str, values: dict[str, Any], step: int) -> None:
        if self.directory is None:
            return
        path = self.directory / f"{name}.csv"
        new = not path.exists()
        with open(path, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(values))
            if new:
                w.writeheader()
            w.writerow(values)
        if self.writer is not None:
            for key, value in values.items():
                if isinstance(value, int | float) and key not in ("epoch", "iteration"):
                    self.writer.add_scalar(f"{name}/{key}", value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
