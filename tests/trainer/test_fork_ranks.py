"""tests/trainer/conftest.fork_ranks: the forked ranks end with the wait for them."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.trainer.conftest import fork_ranks


def _hang(rank: int, out: str) -> None:
    Path(out, f"rank{rank}").write_text(str(os.getpid()))
    time.sleep(600)  # a rank stuck (a collective whose peer never comes)


class Alarm(Exception):
    pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_a_wait_stopped_by_the_tests_timeout_leaves_no_rank_running(tmp_path):
    def alarm(signum, frame):
        raise Alarm  # as pytest-timeout's signal method fails a test: in the waiting thread

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, 3.0)
    try:
        with pytest.raises(Alarm):
            fork_ranks(_hang, (str(tmp_path),))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    pids = [int((tmp_path / f"rank{r}").read_text()) for r in range(2)]
    deadline = time.monotonic() + 5
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [pid for pid in pids if _alive(pid)]
    for pid in left:  # (the test stops what it started, even when it fails)
        os.kill(pid, signal.SIGKILL)
    assert not left, f"ranks {left} ran on after the wait for them was stopped"
