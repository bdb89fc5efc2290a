"""The cache disk's share of a broadcast: exports (a ready dataset packed to be sent)
and deliveries (room reserved for what another node sends here).

Both are folders under the cache directory, so they live on the node-local disk
the cache admits against: ``outgoing/<label>/`` and ``incoming/<label>/``. Their
bytes count as pending in admission until they are gone, so a broadcast never
fills the disk behind the cache's back. Both expire (a job that died leaves
nothing for long), and both are orphans at start: a daemon that restarts deletes
whatever an earlier run left there.

Bookkeeping here is plain and in memory; the blocking file work is done by the
functions below, which the daemon runs off its event loop.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from stager.errors import Conflict, NotFound
from stager.fanout import bundle
from stager.fanout.manifest import digest
from stager.fanout.wire import BUNDLE_NAME, MANIFEST_NAME, ExportPublic, IncomingPublic

EXPORT_TTL_S = 3600.0


def _now() -> datetime:
    return datetime.now(UTC)


@dataclass
class Transfer:
    label: str
    path: Path  # the folder
    nbytes: int  # counted by admission until released
    expires_at: datetime


class Transfers:
    """The reservations of one kind (exports or deliveries) under one folder."""

    def __init__(self, root: Path, kind: str) -> None:
        self.root = root
        self.kind = kind  # "export" or "delivery", for messages
        self._live: dict[str, Transfer] = {}

    def pending_bytes(self) -> int:
        return sum(t.nbytes for t in self._live.values())

    def add(self, label: str, nbytes: int, ttl_s: float) -> Transfer:
        """Book ``label`` (again: the same label renews it, as a re-run step would)."""
        transfer = Transfer(label, self.root / label, nbytes, _now() + timedelta(seconds=ttl_s))
        self._live[label] = transfer
        return transfer

    def get(self, label: str) -> Transfer:
        try:
            return self._live[label]
        except KeyError:
            raise NotFound(
                f"no {self.kind} {label!r} on this node (released, expired, or this daemon "
                "restarted since); start the multi-node staging again"
            ) from None

    def pop(self, label: str) -> Transfer:
        transfer = self.get(label)
        del self._live[label]
        return transfer

    def expired(self) -> list[Transfer]:
        now = _now()
        gone = [t for t in self._live.values() if t.expires_at <= now]
        for transfer in gone:
            del self._live[transfer.label]
        return gone

    def claim(self, label: str) -> Transfer:
        """The delivery an adoption consumes: no longer released by its requester."""
        transfer = self.pop(label)
        if not transfer.path.is_dir():
            raise Conflict(f"{self.kind} {label!r} has no folder on this node any more")
        return transfer


# ---- blocking work, run off the event loop -------------------------------------------


def make_folder(transfer: Transfer) -> None:
    transfer.path.mkdir(parents=True, exist_ok=True)


def remove_folder(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def leftovers(root: Path) -> list[Path]:
    """Folders an earlier run of the daemon left: nothing owns them now."""
    root.mkdir(parents=True, exist_ok=True)
    return [root / name for name in os.listdir(root)]


def pack_export(tree: Path, transfer: Transfer, key: str) -> ExportPublic:
    """Write the bundle and its manifest for ``tree`` into the export's folder."""
    make_folder(transfer)
    manifest = bundle.pack(tree, transfer.path / BUNDLE_NAME)
    data = manifest.to_bytes()
    (transfer.path / MANIFEST_NAME).write_bytes(data)
    return ExportPublic(
        id=transfer.label,
        key=key,
        bundle=str(transfer.path / BUNDLE_NAME),
        manifest=str(transfer.path / MANIFEST_NAME),
        manifest_sha256=digest(data),
        bundle_bytes=(transfer.path / BUNDLE_NAME).stat().st_size,
    )


def incoming_public(transfer: Transfer) -> IncomingPublic:
    return IncomingPublic(
        id=transfer.label,
        path=str(transfer.path),
        bytes=transfer.nbytes,
        expires_at=transfer.expires_at,
    )


def bundle_estimate(size_bytes: int, files: int) -> int:
    """A tar of ``files`` files of ``size_bytes`` in all: data, a 512-byte header and up
    to 511 bytes of padding per file (a PAX header too for long names), two end blocks."""
    return size_bytes + files * 2048 + 10240
