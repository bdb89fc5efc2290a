"""A burst of like events is one log line, then one line a window with its count,
however many there are (20,000 refused connections once wrote ~70 MB of tracebacks).
The daemon's own bursts are in test_connection_limits.py; here the windows' order."""

from __future__ import annotations

import asyncio
import logging

import pytest

from stager.api.connections import BurstLog


def test_a_burst_is_one_line_then_one_a_window_with_its_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def bursts() -> None:
        log = BurstLog(logging.getLogger("test.burst"), every_s=0.05)
        for _ in range(100):
            log.event("refused", "refused x")
        await asyncio.sleep(0.07)  # the first window closes: its count
        for _ in range(5):
            log.event("refused", "refused x")
        await asyncio.sleep(0.07)  # the second window closes: its count
        await asyncio.sleep(0.07)  # a quiet window: the burst is over
        log.event("refused", "refused x")  # a new burst: told at once
        log.event("timeout", "timed out y")  # another kind: its own line
        log.event("timeout", "timed out y")
        log.flush()  # the daemon stops: what is still counted is told

    with caplog.at_level(logging.WARNING, logger="test.burst"):
        asyncio.run(bursts())
    assert [record.getMessage() for record in caplog.records] == [
        "refused x",
        "99 more like this since the last line: refused x",
        "5 more like this since the last line: refused x",
        "refused x",
        "timed out y",
        "1 more like this since the last line: timed out y",
    ]
