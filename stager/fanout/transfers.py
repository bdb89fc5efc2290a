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
import stat
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from stager.errors import NotFound
from stager.fanout import bundle
from stager.fanout.manifest import Manifest, digest
from stager.schemas import MANIFEST_NAME, ExportPublic, TransferPublic, part_name

EXPORT_TTL_S = 3600.0


def _now() -> datetime:
    return datetime.now(UTC)


@dataclass
class Transfer:
    label: str
    path: Path  # the folder
    nbytes: int  # counted by admission until released
    expires_at: datetime


@dataclass
class ExportPlan:
    """An export under way: the ready tree cut into parts, packed one at a time."""

    tree: Path
    key: str
    parts: list[bundle.Entries]
    manifest: Manifest
    packed: int = 0  # parts written so far
    packing: bool = False  # a part is being written now

    @property
    def data_bytes(self) -> int:
        return sum(i.st_size for part in self.parts for _, i in part if stat.S_ISREG(i.st_mode))

    @property
    def total_bytes(self) -> int:
        return bundle_estimate(self.data_bytes, sum(len(part) for part in self.parts))


class Transfers:
    """The reservations of one kind (exports or deliveries) under one folder."""

    def __init__(self, root: Path, kind: str) -> None:
        self.root = root
        self.kind = kind  # "export" or "delivery", for messages
        self._live: dict[str, Transfer] = {}

    def live(self) -> list[Transfer]:
        return list(self._live.values())

    def find(self, label: str) -> Transfer | None:
        return self._live.get(label)

    def add(self, label: str, nbytes: int, ttl_s: float) -> Transfer:
        """Book ``label`` (again: the same label renews it, as a re-run step would)."""
        transfer = Transfer(label, self.root / label, nbytes, _now() + timedelta(seconds=ttl_s))
        self._live[label] = transfer
        return transfer

    def get(self, label: str) -> Transfer:
        transfer = self._live.get(label)
        if transfer is None:
            raise NotFound(
                f"no {self.kind} {label!r} on this node (released, expired, or this daemon "
                "restarted since); start the multi-node staging again"
            )
        return transfer

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


# ---- blocking work, run off the event loop -------------------------------------------


def make_folder(transfer: Transfer) -> None:
    transfer.path.mkdir(parents=True, exist_ok=True)


def remove_folder(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def unwritten_bytes(transfers: list[Transfer]) -> int:
    """Room promised to transfers that their files do not take yet."""
    total = 0
    for transfer in transfers:
        written = 0
        try:
            with os.scandir(transfer.path) as files:
                written = sum(f.stat(follow_symlinks=False).st_size for f in files)
        except FileNotFoundError:
            pass
        total += max(0, transfer.nbytes - written)
    return total


def plan_export(tree: Path, key: str, part_bytes: int) -> ExportPlan:
    return ExportPlan(tree, key, bundle.plan(tree, part_bytes), Manifest())


def pack_export_part(plan: ExportPlan, transfer: Transfer) -> ExportPublic:
    """Write the next part (and, with the last, the manifest) into the export's folder."""
    make_folder(transfer)
    index = plan.packed
    out = transfer.path / part_name(index)
    bundle.pack_part(plan.tree, out, plan.parts[index], plan.manifest)
    plan.packed += 1
    public = ExportPublic(
        id=transfer.label,
        key=plan.key,
        part=index,
        parts=len(plan.parts),
        path=str(out),
        bytes=out.stat().st_size,
        total_bytes=plan.total_bytes,
        data_bytes=plan.data_bytes,
    )
    if plan.packed == len(plan.parts):
        data = plan.manifest.to_bytes()
        (transfer.path / MANIFEST_NAME).write_bytes(data)
        public.manifest = str(transfer.path / MANIFEST_NAME)
        public.manifest_sha256 = digest(data)
    return public


def transfer_public(transfer: Transfer) -> TransferPublic:
    return TransferPublic(
        id=transfer.label,
        path=str(transfer.path),
        bytes=transfer.nbytes,
        expires_at=transfer.expires_at,
    )


def bundle_estimate(size_bytes: int, files: int) -> int:
    """A tar of ``files`` files of ``size_bytes`` in all: data, a 512-byte header and up
    to 511 bytes of padding per file (a PAX header too for long names), two end blocks."""
    return size_bytes + files * 2048 + 10240
