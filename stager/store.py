"""SQLite state under the cache root: entries and handles survive restarts.

The stdlib driver is blocking, so the engine calls these methods through
``stager.blocking.run_io``. One connection guarded by a lock; WAL so that a
crash mid-write never corrupts what was committed.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from datetime import datetime
from pathlib import Path

from stager.dataset import STEPS_ADAPTER, Entry, Handle
from stager.progress import Progress
from stager.schemas import ErrorInfo, ProgressPublic, State

SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    key TEXT PRIMARY KEY,
    spec TEXT NOT NULL,
    steps TEXT NOT NULL,
    verify TEXT NOT NULL,
    state TEXT NOT NULL,
    error TEXT,
    progress TEXT NOT NULL,
    size_bytes INTEGER NOT NULL DEFAULT 0,
    estimate_bytes INTEGER NOT NULL DEFAULT 0,
    created_at TEXT NOT NULL,
    updated_at TEXT NOT NULL,
    usage TEXT NOT NULL DEFAULT '[]'
);
CREATE TABLE IF NOT EXISTS handles (
    name TEXT PRIMARY KEY,
    key TEXT NOT NULL,
    link TEXT,
    created_at TEXT NOT NULL
);
"""


class Store:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def save_entry(self, entry: Entry) -> None:
        row = (
            entry.key,
            json.dumps(entry.spec),
            STEPS_ADAPTER.dump_json(entry.steps).decode(),
            entry.verify,
            entry.state.value,
            entry.error.model_dump_json() if entry.error else None,
            entry.progress.snapshot().model_dump_json(),
            entry.size_bytes,
            entry.estimate_bytes,
            entry.created_at.isoformat(),
            entry.updated_at.isoformat(),
            json.dumps(entry.usage),
        )
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO entries VALUES (?,?,?,?,?,?,?,?,?,?,?,?)", row)

    def save_progress(self, entries: list[Entry]) -> None:
        rows = [(e.progress.snapshot().model_dump_json(), e.key) for e in entries]
        with self._lock:
            self._db.executemany("UPDATE entries SET progress = ? WHERE key = ?", rows)

    def save_handle(self, handle: Handle) -> None:
        row = (handle.name, handle.key, handle.link, handle.created_at.isoformat())
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO handles VALUES (?,?,?,?)", row)

    def delete_handle(self, name: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM handles WHERE name = ?", (name,))

    def load(self) -> tuple[list[Entry], list[Handle]]:
        with self._lock:
            entry_rows = self._db.execute("SELECT * FROM entries").fetchall()
            handle_rows = self._db.execute("SELECT * FROM handles").fetchall()
        entries = [_entry_from_row(row) for row in entry_rows]
        handles = [
            Handle(name=n, key=k, link=link, created_at=datetime.fromisoformat(c))
            for n, k, link, c in handle_rows
        ]
        return entries, handles


def _entry_from_row(row: tuple) -> Entry:
    key, spec, steps, verify, state, error, progress, size, estimate, created, updated, usage = row
    return Entry(
        key=key,
        spec=json.loads(spec),
        steps=STEPS_ADAPTER.validate_json(steps),
        verify=verify,
        state=State(state),
        error=ErrorInfo.model_validate_json(error) if error else None,
        progress=Progress.restore(ProgressPublic.model_validate_json(progress)),
        size_bytes=size,
        estimate_bytes=estimate,
        usage=json.loads(usage),
        created_at=datetime.fromisoformat(created),
        updated_at=datetime.fromisoformat(updated),
    )
