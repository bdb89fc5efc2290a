"""Progress displays: plain log lines on a fake clock, and the rich bar on a fake terminal."""

from __future__ import annotations

import io

from rich.console import Console

from client._progress import BarDisplay, LogDisplay, summary
from stager.schemas import DatasetPublic


def make(state: str = "staging", **progress: object) -> DatasetPublic:
    return DatasetPublic.model_validate(
        {
            "name": "inat",
            "key": "k",
            "state": state,
            "path": "/cache/inat" if state == "ready" else None,
            "size_bytes": 3_000_000 if state == "ready" else 0,
            "progress": {"step": "extract", "step_index": 1, "steps_total": 4, **progress},
            "created_at": "2024-01-01T00:00:00Z",
            "updated_at": "2024-01-01T00:00:00Z",
        }
    )


def test_summary_has_bytes_files_rate_and_eta() -> None:
    line = summary(
        make(
            bytes_done=1_500_000_000,
            bytes_total=3_000_000_000,
            files_done=120,
            files_total=400,
            rate_bytes_per_s=2.5e8,
            eta_s=75,
        )  # fmt: skip
    )
    assert line == (
        "inat: staging step 2/4 extract, 1.5 GB/3.0 GB (50%), 120/400 files, 250.0 MB/s, eta 1:15"
    )
    assert summary(make("ready")) == "inat: ready at /cache/inat (3.0 MB)"


def test_log_lines_are_throttled_per_dataset_and_end_once() -> None:
    out = io.StringIO()
    now = [0.0]
    display = LogDisplay(out, interval=30, clock=lambda: now[0], stamp=lambda: "T")
    for t in (0, 10, 29, 30, 45, 61):
        now[0] = t
        display.update(make(bytes_done=t))
    display.update(make("ready"))
    display.update(make("ready"))
    lines = out.getvalue().splitlines()
    assert [line.split(",")[1].strip() for line in lines[:-1]] == [
        "0 bytes",
        "30 bytes",
        "61 bytes",
    ]
    assert lines[-1] == "[T] inat: ready at /cache/inat (3.0 MB)"


def test_bar_shows_name_bytes_files_rate_and_eta() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=160, color_system=None)
    display = BarDisplay(console)
    display.update(make(bytes_done=500, bytes_total=1000, files_done=3, files_total=9,
                        rate_bytes_per_s=100, eta_s=5))  # fmt: skip
    display.close()
    text = out.getvalue()
    for part in ("inat", "500 bytes/1.0 kB (50%)", "3/9 files", "100 bytes/s", "eta 5 s"):
        assert part in text
