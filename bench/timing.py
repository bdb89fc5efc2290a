"""Timing a candidate that writes into a folder, the same way for every benchmark:
each run into a fresh folder, after ``sync`` (so one run's writeback is not the
next one's cost), and the spread of several runs."""

from __future__ import annotations

import os
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path


def timed(runner: Callable[[Path], None], out: Path) -> float:
    """Seconds ``runner(out)`` takes, ``out`` made empty and the disk synced first."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    os.sync()
    start = time.perf_counter()
    runner(out)
    return time.perf_counter() - start


def spread(values: list[float]) -> str:
    """(max - min) / median, as a percentage."""
    return f"{(max(values) - min(values)) / statistics.median(values) * 100:.0f}%"
