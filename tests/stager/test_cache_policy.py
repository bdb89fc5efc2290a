"""The admission policy as a pure function (what to evict so a new staging fits), and
the deletion of what was evicted."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from stager.core.errors import InsufficientSpace, QuotaExceeded
from stager.fs.credentials import Reader
from stager.fs.deletion import delete_tree
from stager.state.cache import pending_bytes, plan_admission, plan_quota
from stager.state.dataset import Entry
from stager.wire.schemas import State

MB = 1_000_000


def entry(key: str, state: State, size: int = 0, estimate: int = 0, age_s: int = 0) -> Entry:
    made = Entry(key=key, spec={}, steps=[], verify="size", state=state)
    made.size_bytes, made.estimate_bytes = size, estimate
    made.last_used_at = datetime.now(UTC) - timedelta(seconds=age_s)
    return made


def test_a_staging_under_way_counts_what_it_has_still_to_write() -> None:
    running = entry("running", State.STAGING, estimate=100 * MB)
    running.progress.add_total(200 * MB)
    running.progress.advance(50 * MB)  # a quarter done: 75 MB still to come
    assert pending_bytes([running, entry("queued", State.QUEUED, estimate=10 * MB)]) == 85 * MB


def test_free_space_promised_to_running_stagings_is_not_handed_out_twice() -> None:
    running = entry("running", State.STAGING, estimate=80 * MB)
    old = entry("old", State.READY, size=50 * MB, age_s=100)
    newer = entry("newer", State.READY, size=50 * MB, age_s=10)
    # 100 MB free on the disk, but 80 MB of it belongs to the running staging.
    plan = plan_admission(
        needed=40 * MB,
        entries=[running, old, newer],
        protected={"running"},
        capacity_bytes=0,
        free_bytes=100 * MB,
        min_free_bytes=0,
    )
    assert [e.key for e in plan] == ["old"]  # least recently used first, and only enough


def test_refusal_names_the_sizes_and_what_running_stagings_hold() -> None:
    running = entry("running", State.STAGING, estimate=80 * MB)
    with pytest.raises(InsufficientSpace) as refused:
        plan_admission(
            needed=40 * MB,
            entries=[running],
            protected={"running"},
            capacity_bytes=0,
            free_bytes=100 * MB,
            min_free_bytes=0,
        )
    message = refused.value.message
    assert "needs about 38.1 MiB" in message
    assert "76.3 MiB of it promised to stagings under way" in message
    assert "--cache-dir" in message


def test_delete_tree_removes_everything_without_following_links(tmp_path: Path) -> None:
    keep = tmp_path / "elsewhere"
    (keep / "sub").mkdir(parents=True)
    (keep / "sub" / "precious").write_text("x")
    doomed = tmp_path / "evicted"
    (doomed / "a" / "b").mkdir(parents=True)
    for i in range(5):
        (doomed / "a" / "b" / f"f{i}").write_text("x")
    (doomed / "a" / "to_dir").symlink_to(keep)
    (doomed / "a" / "to_file").symlink_to(keep / "sub" / "precious")
    assert delete_tree(doomed, threading.Event()) is True
    assert not doomed.exists()
    assert (keep / "sub" / "precious").read_text() == "x"


def test_delete_tree_stops_when_the_daemon_stops(tmp_path: Path) -> None:
    doomed = tmp_path / "evicted"
    doomed.mkdir()
    for i in range(100):
        (doomed / f"f{i}").write_text("x")
    stop = threading.Event()
    stop.set()
    assert delete_tree(doomed, stop) is False
    assert len(list(doomed.iterdir())) == 100  # left for the next start's cleanup


def owned(key: str, uid: int | None, size: int, age_s: int = 0) -> Entry:
    """A ready entry that is ``uid``'s own copy (None: shared by every user)."""
    made = entry(key, State.READY, size=size, age_s=age_s)
    made.reader = Reader(uid if uid is not None else 0, 0, (), public=uid is None)
    return made


def test_a_users_quota_evicts_only_their_own_data_oldest_first() -> None:
    mine_old, mine_new = owned("mine-old", 1001, 40 * MB, 100), owned("mine-new", 1001, 40 * MB, 1)
    theirs, shared = owned("theirs", 1002, 90 * MB, 500), owned("shared", None, 90 * MB, 900)
    everything = [mine_old, mine_new, theirs, shared]
    assert plan_quota(20 * MB, 1001, everything, set(), 100 * MB) == []
    assert plan_quota(30 * MB, 1001, everything, set(), 100 * MB) == [mine_old]
    assert plan_quota(70 * MB, 1001, everything, set(), 100 * MB) == [mine_old, mine_new]
    # Other users' data and shared data count against nobody's quota: 1002 is within it.
    assert plan_quota(10 * MB, 1002, everything, set(), 100 * MB) == []


def test_past_the_quota_with_everything_leased_is_refused_naming_the_quota() -> None:
    mine = owned("mine", 1001, 80 * MB)
    with pytest.raises(QuotaExceeded, match=r"quota of 95\.4 MiB"):
        plan_quota(30 * MB, 1001, [mine], {"mine"}, 100 * MB)
    with pytest.raises(QuotaExceeded, match="--user-quota"):
        plan_quota(200 * MB, 1001, [], set(), 100 * MB)
