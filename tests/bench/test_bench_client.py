"""bench_client keeps staging until it has --runs real samples of the ready -> wait delay.

A real daemon cannot be told to finish a staging before ``wait()`` starts, so a fake
client plays one: every other staging is already ready when it is waited for.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench.bench_client import MAX_STAGINGS_PER_RUN, ready_delays


class FakeClient:
    def __init__(self, late_every: int) -> None:
        self.late_every = late_every
        self.staged: list[str] = []

    def stage(self, name: str, steps: list[dict]) -> None:
        self.staged.append(name)

    def wait(self, name: str, timeout: float) -> SimpleNamespace:
        late = len(self.staged) % self.late_every == 0
        ready_at = datetime.now(UTC) + timedelta(seconds=-10 if late else 0.001)
        return SimpleNamespace(updated_at=ready_at)


def test_late_stagings_are_replaced_until_runs_samples_are_in(tmp_path: Path) -> None:
    client = FakeClient(late_every=2)
    delays, stagings = ready_delays(client, tmp_path, runs=5)  # type: ignore[arg-type]
    assert len(delays) == 5
    assert stagings == len(client.staged) == 9  # the 2nd, 4th, 6th and 8th were late
    assert client.staged == [f"run-{i}" for i in range(9)]  # each a new name


def test_gives_up_when_almost_every_staging_is_late(tmp_path: Path) -> None:
    client = FakeClient(late_every=1)
    with pytest.raises(RuntimeError, match="make the source in make_source"):
        ready_delays(client, tmp_path, runs=3)  # type: ignore[arg-type]
    assert len(client.staged) == 3 * MAX_STAGINGS_PER_RUN
