"""SQLite state under the cache root: entries, names and leases survive restarts.
Blocking (called through ``run_io``); one connection under a lock; WAL, so a crash
mid-write never corrupts what was committed.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import Any

from stager.fs.credentials import Reader
from stager.fs.seal import Seal
from stager.image.published import ImageRecord
from stager.ops.table import OpTable
from stager.state.dataset import Entry, Handle
from stager.state.leases import Lease
from stager.wire.progress import Progress
from stager.wire.schemas import ErrorInfo, ProgressPublic, State

HANDLES = """
CREATE TABLE IF NOT EXISTS handles (
    owner INTEGER NOT NULL,
    name TEXT NOT NULL,
    key TEXT NOT NULL,
    spec_key TEXT NOT NULL,
    link TEXT,
    created_at TEXT NOT NULL,
    hit INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (owner, name)
);
"""
SCHEMA = (
    HANDLES
    + """
CREATE TABLE IF NOT EXISTS entries (
    key TEXT PRIMARY KEY,
    spec TEXT NOT NULL,
    steps TEXT NOT NULL,
    verify TEXT NOT NULL,
    state TEXT NOT NULL,
    error TEXT,
    progress TEXT NOT NULL,
    usage TEXT NOT NULL,
    size_bytes INTEGER NOT NULL,
    estimate_bytes INTEGER NOT NULL,
    created_at TEXT NOT NULL,
    updated_at TEXT NOT NULL,
    last_used_at TEXT NOT NULL,
    attempt TEXT,
    origin TEXT
);
CREATE TABLE IF NOT EXISTS leases (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    key TEXT NOT NULL,
    holder TEXT NOT NULL,
    owner INTEGER NOT NULL,
    slurm_job_id TEXT,
    created_at TEXT NOT NULL,
    expires_at TEXT
);
"""
)


class Store:
    def __init__(self, path: Path, ops: OpTable) -> None:
        self._ops = ops
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        # The state names every user's datasets, sources and leases: the daemon's alone
        # (its -wal and -shm files take the database's mode).
        os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
        os.chmod(path, 0o600)
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._give_names_owners()
        self._db.executescript(SCHEMA)
        # Columns added since the first release: a cache made before them gains them.
        for table, column, kind in (
            ("entries", "attempt", "TEXT"),
            ("entries", "origin", "TEXT"),
            ("entries", "seal", "TEXT"),
            ("entries", "reader", "TEXT"),
            ("entries", "image", "TEXT"),
            ("handles", "hit", "INTEGER NOT NULL DEFAULT 0"),
            ("handles", "ended", "TEXT"),
        ):
            columns = {row[1] for row in self._db.execute(f"PRAGMA table_info({table})")}
            if column not in columns:
                self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")

    def _give_names_owners(self) -> None:
        """A handles table without an owner column was a one-user daemon's: its names
        and leases become this daemon's uid's, keyed (owner, name)."""
        tables = {row[0] for row in self._db.execute("SELECT name FROM sqlite_master")}
        if "handles" not in tables:
            return
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(handles)")}
        if "owner" in columns:
            return
        uid = os.getuid()
        with self._lock:
            self._db.execute("BEGIN")
            self._db.execute("ALTER TABLE handles RENAME TO handles_without_owners")
            self._db.execute(HANDLES)
            self._db.execute(
                "INSERT INTO handles (owner, name, key, spec_key, link, created_at, hit) "
                "SELECT ?, name, key, spec_key, link, created_at, hit "
                "FROM handles_without_owners",
                (uid,),
            )
            self._db.execute("DROP TABLE handles_without_owners")
            if "leases" in tables:
                self._db.execute(
                    f"ALTER TABLE leases ADD COLUMN owner INTEGER NOT NULL DEFAULT {uid:d}"
                )
            self._db.execute("COMMIT")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _upsert(self, table: str, row: dict[str, Any]) -> None:
        columns = ",".join(row)
        marks = ",".join("?" for _ in row)
        with self._lock:
            self._db.execute(
                f"INSERT OR REPLACE INTO {table} ({columns}) VALUES ({marks})", tuple(row.values())
            )

    def save_entry(self, entry: Entry) -> None:
        self._upsert(
            "entries",
            {
                "key": entry.key,
                "spec": json.dumps(entry.spec),
                "steps": json.dumps(self._ops.dump_steps(entry.steps)),
                "verify": entry.verify,
                "state": entry.state.value,
                "error": entry.error.model_dump_json() if entry.error else None,
                "progress": entry.progress.snapshot().model_dump_json(),
                "usage": json.dumps(entry.usage),
                "size_bytes": entry.size_bytes,
                "estimate_bytes": entry.estimate_bytes,
                "created_at": entry.created_at.isoformat(),
                "updated_at": entry.updated_at.isoformat(),
                "last_used_at": entry.last_used_at.isoformat(),
                "attempt": entry.attempt,
                "origin": json.dumps(entry.origin) if entry.origin else None,
                "seal": json.dumps(entry.seal.to_dict()) if entry.seal else None,
                "reader": json.dumps(asdict(entry.reader)) if entry.reader else None,
                "image": json.dumps(entry.image.to_dict()) if entry.image else None,
            },
        )

    def save_progress(self, entries: list[Entry]) -> None:
        rows = [(e.progress.snapshot().model_dump_json(), e.key) for e in entries]
        with self._lock:
            self._db.executemany("UPDATE entries SET progress = ? WHERE key = ?", rows)

    def save_handle(self, handle: Handle) -> None:
        row = {**handle.__dict__, "created_at": handle.created_at.isoformat()}
        row["ended"] = handle.ended.value if handle.ended is not None else None
        self._upsert("handles", row)

    def delete_handle(self, owner: int, name: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM handles WHERE owner = ? AND name = ?", (owner, name))

    def save_lease(self, lease: Lease) -> None:
        row = {**lease.__dict__, "created_at": lease.created_at.isoformat()}
        row["expires_at"] = lease.expires_at.isoformat() if lease.expires_at else None
        self._upsert("leases", row)

    def delete_lease(self, lease_id: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM leases WHERE id = ?", (lease_id,))

    def load(self) -> tuple[list[Entry], list[Handle], list[Lease]]:
        with self._lock:
            self._db.row_factory = sqlite3.Row
            try:
                entries = self._db.execute("SELECT * FROM entries").fetchall()
                handles = self._db.execute("SELECT * FROM handles").fetchall()
                leases = self._db.execute("SELECT * FROM leases").fetchall()
            finally:
                self._db.row_factory = None
        return (
            [self._entry(dict(r)) for r in entries],
            [_handle(dict(r)) for r in handles],
            [_lease(dict(r)) for r in leases],
        )

    def _entry(self, row: dict[str, Any]) -> Entry:
        steps = self._ops.validate_steps_json(row["steps"])
        return Entry(
            key=row["key"],
            spec=json.loads(row["spec"]),
            steps=steps,
            verify=row["verify"],
            state=State(row["state"]),
            error=ErrorInfo.model_validate_json(row["error"]) if row["error"] else None,
            progress=Progress.restore(
                ProgressPublic.model_validate_json(row["progress"]), [s.op for s in steps]
            ),
            usage=json.loads(row["usage"]),
            size_bytes=row["size_bytes"],
            estimate_bytes=row["estimate_bytes"],
            created_at=datetime.fromisoformat(row["created_at"]),
            updated_at=datetime.fromisoformat(row["updated_at"]),
            last_used_at=datetime.fromisoformat(row["last_used_at"]),
            attempt=row.get("attempt"),
            origin=json.loads(row["origin"]) if row.get("origin") else None,
            seal=Seal.from_dict(json.loads(row["seal"])) if row.get("seal") else None,
            reader=_reader(row.get("reader")),
            image=ImageRecord.from_dict(json.loads(row["image"])) if row.get("image") else None,
        )


def _reader(text: str | None) -> Reader | None:
    if not text:
        return None
    raw = json.loads(text)
    return Reader(raw["uid"], raw["gid"], tuple(raw["groups"]), raw["public"])


def _handle(row: dict[str, Any]) -> Handle:
    created = datetime.fromisoformat(row["created_at"])
    ended = State(row["ended"]) if row.get("ended") else None
    return Handle(**{**row, "created_at": created, "hit": bool(row.get("hit")), "ended": ended})


def _lease(row: dict[str, Any]) -> Lease:
    expires = row["expires_at"]
    return Lease(
        **{
            **row,
            "created_at": datetime.fromisoformat(row["created_at"]),
            "expires_at": datetime.fromisoformat(expires) if expires else None,
        }
    )
