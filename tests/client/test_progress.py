"""What the client shows, from statuses a real daemon sent (see ``recorded.py``).

The daemon's ``step_index`` is 1-based while a step runs and 0 before the first
one; the client prints it as it comes ("step 1/3" during the first of three).
"""

from __future__ import annotations

import io

import pytest
from rich.console import Console
from rich.filesize import decimal

from client._client import _timed_out
from client._progress import BarDisplay, LogDisplay, describe_step, summary
from stager.wire.schemas import DatasetPublic
from tests.client.recorded import Recorded, record


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Recorded:
    return record(tmp_path_factory.mktemp("recorded"))


def status(raw: dict, **progress: object) -> DatasetPublic:
    """A recorded status, with progress counters moved on where a test needs it."""
    view = DatasetPublic.model_validate(raw)
    return view.model_copy(update={"progress": view.progress.model_copy(update=progress)})


def test_the_first_of_three_steps_shows_as_step_1_of_3(recorded: Recorded) -> None:
    first = status(recorded.first_step)
    assert (first.progress.step_index, first.progress.steps_total) == (1, recorded.steps_total)
    assert describe_step(first.progress) == "step 1/3 fetch"
    assert summary(first).startswith("held: staging step 1/3 fetch")


def test_a_queued_dataset_shows_no_step(recorded: Recorded) -> None:
    queued = status(recorded.queued)
    assert queued.progress.step_index == 0
    assert describe_step(queued.progress) == ""
    assert summary(queued) == "behind: queued"


def test_a_timeout_names_the_step_that_is_running(recorded: Recorded) -> None:
    message = str(_timed_out(status(recorded.first_step), 5))
    assert "after 5 s (step 1/3 fetch" in message
    assert "not started" in str(_timed_out(status(recorded.queued), 5))


def test_ready_summary_has_path_and_size(recorded: Recorded) -> None:
    ready = status(recorded.ready)
    assert ready.size_bytes > 0
    assert summary(ready) == f"held: ready at {ready.path} ({decimal(ready.size_bytes)})"


def test_summary_has_bytes_files_rate_and_eta(recorded: Recorded) -> None:
    moved_on = status(
        recorded.first_step,
        bytes_done=1_500_000_000,
        bytes_total=3_000_000_000,
        files_done=120,
        files_total=400,
        rate_bytes_per_s=2.5e8,
        eta_s=75,
    )
    assert summary(moved_on) == (
        "held: staging step 1/3 fetch, 1.5 GB/3.0 GB (50%), 120/400 files, 250.0 MB/s, eta 1:15"
    )


def test_log_lines_are_throttled_per_dataset_and_end_once(recorded: Recorded) -> None:
    out = io.StringIO()
    now = [0.0]
    display = LogDisplay(out, interval=30, clock=lambda: now[0], stamp=lambda: "T")
    for t in (0, 10, 29, 30, 45, 61):
        now[0] = t
        display.update(status(recorded.first_step, bytes_done=t, bytes_total=100))
    ready = status(recorded.ready)
    display.update(ready)
    display.update(ready)
    lines = out.getvalue().splitlines()
    assert [line.split(",")[1].strip().split(" ")[0] for line in lines[:-1]] == ["0", "30", "61"]
    assert lines[-1] == f"[T] {summary(ready)}"


def test_bar_shows_name_bytes_files_rate_and_eta(recorded: Recorded) -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=160, color_system=None)
    display = BarDisplay(console)
    display.update(status(recorded.first_step, bytes_done=500, bytes_total=1000, files_done=3,
                          files_total=9, rate_bytes_per_s=100, eta_s=5))  # fmt: skip
    display.close()
    text = out.getvalue()
    for part in ("held", "500 bytes/1.0 kB (50%)", "3/9 files", "100 bytes/s", "eta 5 s"):
        assert part in text
