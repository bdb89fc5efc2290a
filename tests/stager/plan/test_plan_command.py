"""`stager plan --dry-run` over a recorded squeue output: what it would do, and why."""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path

import pytest

from stager.cli import main
from tests.stager.plan.queue import INAT, row


def recorded(tmp_path: Path, *rows: str) -> Path:
    path = tmp_path / "squeue.txt"
    path.write_text("\n".join(rows) + "\n")
    return path


def test_dry_run_prints_each_job_planned_or_skipped_with_its_reason(tmp_path, capsys) -> None:
    soon = datetime.now() + timedelta(minutes=5)
    queue = recorded(
        tmp_path,
        row("10", uid=1001, start=soon, sched="gpu[1-2]", declared=[INAT]),
        row("11", uid=0, start=soon, declared=[INAT]),
        row("12", uid=1001, start=soon),
        row("13", uid=1001, start=soon + timedelta(hours=2), declared=[INAT]),
    )
    assert main(["plan", "--dry-run", "--squeue-output", str(queue)]) == 0
    out = capsys.readouterr().out
    assert "plan: job 10 of " in out and "on gpu1,gpu2: pre-stage inat" in out
    assert "would stage on gpu1 as " in out and "inat (recipe inat2021 from /net/inat)" in out
    assert "would copy from gpu1 to gpu2 as " in out  # the storage read once
    assert "skip: job 11 of root (uid 0)" in out and "root's job" in out
    assert "skip: job 12 " in out and "declares nothing" in out
    assert "skip: job 13 " in out and "beyond the horizon" in out
    assert "4 pending job(s), 1 planned, 2 prefetch(es) to start, 0 to cancel" in out
    assert main(["plan", "--dry-run", "--squeue-output", str(queue), "--plan-horizon", "9000"]) == 0
    assert "plan: job 13 " in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["plan", "--dry-run", "--plan-interval", "0"], "plan-interval"),
        (["plan", "--once", "--plan-node-addresses", "node1"], "NODE=HOST:PORT"),
        (["plan", "--dry-run", "--squeue-output", "/nonexistent"], "--squeue-output /nonexistent"),
        (["plan", "--dry-run", "--plan-horizon", "-5"], "plan-horizon"),
    ],
)
def test_usage_errors_exit_2_naming_the_input(argv, says, capsys) -> None:
    assert main(argv) == 2
    assert says in capsys.readouterr().err
