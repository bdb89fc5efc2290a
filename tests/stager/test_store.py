"""The state store keeps names per user: a cache made before names had owners opens
with every name and lease its daemon's user's, and two users' same name are two
rows."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

from stager.ops import table
from stager.state.dataset import Entry, Handle
from stager.state.leases import Lease
from stager.state.store import Store
from stager.wire.schemas import LeaseCreate, State

OLD_SCHEMA = """
CREATE TABLE entries (key TEXT PRIMARY KEY, spec TEXT NOT NULL, steps TEXT NOT NULL,
    verify TEXT NOT NULL, state TEXT NOT NULL, error TEXT, progress TEXT NOT NULL,
    usage TEXT NOT NULL, size_bytes INTEGER NOT NULL, estimate_bytes INTEGER NOT NULL,
    created_at TEXT NOT NULL, updated_at TEXT NOT NULL, last_used_at TEXT NOT NULL,
    attempt TEXT, origin TEXT);
CREATE TABLE handles (name TEXT PRIMARY KEY, key TEXT NOT NULL, spec_key TEXT NOT NULL,
    link TEXT, created_at TEXT NOT NULL, hit INTEGER NOT NULL DEFAULT 0);
CREATE TABLE leases (id TEXT PRIMARY KEY, name TEXT NOT NULL, key TEXT NOT NULL,
    holder TEXT NOT NULL, slurm_job_id TEXT, created_at TEXT NOT NULL, expires_at TEXT);
"""


def test_a_cache_from_before_owners_gives_its_names_and_leases_to_its_user(
    tmp_path: Path,
) -> None:
    path = tmp_path / "state.db"
    with sqlite3.connect(path) as db:
        db.executescript(OLD_SCHEMA)
        db.execute(
            "INSERT INTO handles VALUES "
            "('inat', 'k', 's', '/tmp/l', '2026-01-01T00:00:00+00:00', 1)"
        )
        db.execute(
            "INSERT INTO leases VALUES ('l1', 'inat', 'k', 'job-1', NULL, "
            "'2026-01-01T00:00:00+00:00', NULL)"
        )
    store = Store(path, table.load(()))
    _, handles, leases = store.load()
    assert [(h.owner, h.name, h.link, h.hit) for h in handles] == [
        (os.getuid(), "inat", "/tmp/l", True)
    ]
    assert [(x.owner, x.name, x.holder) for x in leases] == [(os.getuid(), "inat", "job-1")]
    store.close()
    Store(path, table.load(())).close()  # opened again: already migrated, nothing to do


def test_two_users_same_name_are_two_handles(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.db", table.load(()))
    entry = Entry(key="k" * 24, spec={}, steps=[], verify="size", state=State.READY)
    store.save_entry(entry)
    for owner in (1001, 1002):
        store.save_handle(Handle("inat", entry.key, "s", owner))
        store.save_lease(Lease.create("inat", owner, entry.key, LeaseCreate(holder="job")))
    _, handles, leases = store.load()
    assert sorted(h.id for h in handles) == [(1001, "inat"), (1002, "inat")]
    assert sorted(x.handle_id for x in leases) == [(1001, "inat"), (1002, "inat")]
    store.delete_handle(1001, "inat")
    _, handles, _ = store.load()
    assert [h.id for h in handles] == [(1002, "inat")]
    store.close()
