"""The blocking file work of a broadcast, run off the event loop by the fan-out room:
transfers' folders, and an export's parts planned and packed.

A transfer is a folder on the cache disk: ``outgoing/<label>/`` (an export) or
``incoming/<label>/`` (a delivery); ``<uid>/<label>/`` in the node service.
"""

from __future__ import annotations

import os
import shutil
import stat
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from stager.archive import ranges
from stager.fanout import bundle, early
from stager.fs.manifest import Digests
from stager.wire.manifest_format import Manifest, digest
from stager.wire.schemas import MANIFEST_NAME, ExportPublic, part_name


@dataclass
class Transfer:
    label: str  # the job's name for it, the same on every node
    path: Path  # the folder
    nbytes: int  # counted by admission until released
    expires_at: datetime
    # The uid (and gid) whose job asked for it (None: the daemon's own, per-user mode):
    # their sbcast writes a delivery and reads an export, nobody else reaches either.
    owner: int | None = None
    group: int | None = None
    # A delivery a staging reads: kept and counted until that staging ends, never
    # expired under it.
    claimed: bool = False
    # The bytes a delivery's folder held when the sweep last measured it, as its owner
    # (the folder is theirs to write: root never walks it).
    written: int = 0


@dataclass
class ExportPlan:
    """An export under way, packed a part at a time. An ``early`` one packs a tree
    still staging; once it is ready, the remaining parts are numbered from ``first``."""

    tree: Path
    key: str
    # Parts ``first`` .. ``first + len(parts) - 1``: of whole entries, or of ranges.
    parts: list[bundle.Entries | ranges.RangePart]
    manifest: Manifest
    data_bytes: int  # the tree's file data (an early export: the staging's estimate)
    part_bytes: int = bundle.PART_BYTES  # about how much file data a part holds
    first: int = 0
    packed: int = 0  # parts written so far
    packing: bool = False  # a part is being written now
    early: bool = False
    sized_by_staging: bool = False  # part size follows the staging's size (not asked for)
    sent: Digests = field(default_factory=Digests)  # files packed, as they were then
    sent_dirs: set[str] = field(default_factory=set)
    # Files sent in ranges so far, by inode, and what the staging removes (never sent).
    growing: dict[int, ranges.Growing] = field(default_factory=dict)
    scratch: frozenset[str] = frozenset()

    @property
    def count(self) -> int:
        return self.first + len(self.parts)

    @property
    def total_bytes(self) -> int:
        members = sum(_members(part) for part in self.parts)
        return bundle_estimate(self.data_bytes, members)


# ---- blocking work, run off the event loop -------------------------------------------


def make_folder(transfer: Transfer, writable_by_owner: bool = False) -> None:
    """The transfer's folder, in one only the service may change. A delivery's
    (``writable_by_owner``) is its owner's, 0700, for their sbcast to write; an
    export's stays the service's (0711), so nobody may plant anything in it."""
    transfer.path.parent.mkdir(mode=0o711, parents=True, exist_ok=True)
    mode = 0o711 if transfer.owner is not None and not writable_by_owner else 0o700
    try:
        transfer.path.mkdir(mode=mode)
    except FileExistsError:
        return
    if transfer.owner is not None and writable_by_owner:
        group = transfer.group if transfer.group is not None else -1
        os.chown(transfer.path, transfer.owner, group)


def hand_over(path: Path, transfer: Transfer) -> None:
    """A packed file: its owner's alone to read (0400), for their sbcast."""
    if transfer.owner is not None:
        group = transfer.group if transfer.group is not None else -1
        os.chown(path, transfer.owner, group, follow_symlinks=False)
        os.chmod(path, 0o400, follow_symlinks=False)


def remove_folder(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def folder_bytes(path: Path) -> int:
    """The bytes of every file and link below ``path``, links never followed."""
    total = 0
    for folder, folders, files in os.walk(path):
        for name in [*folders, *files]:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except FileNotFoundError:
                pass
    return total


def plan_export(tree: Path, key: str, part_bytes: int) -> ExportPlan:
    parts = bundle.plan(tree, part_bytes)
    data = sum(i.st_size for part in parts for _, i in part if stat.S_ISREG(i.st_mode))
    return ExportPlan(tree, key, parts, Manifest(), data, part_bytes)


def plan_rest(plan: ExportPlan, tree: Path) -> None:
    """After the early parts: the parts ready ``tree`` still needs, from part ``packed``."""
    plan.parts, plan.manifest, plan.data_bytes = early.rest(
        tree, plan.sent, plan.part_bytes, plan.growing
    )
    plan.tree, plan.first, plan.early = tree, plan.packed, False


def pack_export_part(plan: ExportPlan, transfer: Transfer) -> ExportPublic:
    """The next part (and, with the last, the manifest) into the export's folder."""
    index = plan.packed
    out = _start_part(plan, transfer)
    _pack(plan, plan.tree, out, plan.parts[index - plan.first], plan.manifest, plan.sent)
    hand_over(out, transfer)
    plan.packed += 1
    public = _part_public(plan, transfer, out)
    if plan.packed == plan.count:
        data = plan.manifest.to_bytes()
        manifest = transfer.path / MANIFEST_NAME
        manifest.write_bytes(data)
        hand_over(manifest, transfer)
        public.manifest = str(manifest)
        public.manifest_sha256 = digest(data)
    return public


def pack_early_part(
    plan: ExportPlan, transfer: Transfer, tree: Path
) -> tuple[ExportPublic | None, float]:
    """The next early part of staging ``tree`` (None: none yet), and when to look again."""
    entries, retry = early.pick(tree, plan.sent, plan.sent_dirs, plan.part_bytes, time.time(),
                                plan.growing, plan.scratch)  # fmt: skip
    if entries is None:
        return None, retry
    out = _start_part(plan, transfer)
    packed = Digests()  # what this part carries counts as sent only once it is whole
    _pack(plan, tree, out, entries, Manifest(), packed)
    hand_over(out, transfer)
    plan.sent.update(packed)
    if not isinstance(entries, ranges.RangePart):
        folders = {path for path, info in entries if stat.S_ISDIR(info.st_mode)}
        plan.sent_dirs.update(folders)
        files = {path for path, _ in entries} - folders
        ranges.replaced(plan.growing, files, folders)
    plan.packed += 1
    public = _part_public(plan, transfer, out)
    public.more, public.retry_after_s = True, retry
    return public, retry


def _pack(
    plan: ExportPlan,
    tree: Path,
    out: Path,
    part: bundle.Entries | ranges.RangePart,
    manifest: Manifest,
    sent: Digests,
) -> None:
    if isinstance(part, ranges.RangePart):
        ranges.pack(tree, out, part, plan.growing, manifest, sent)
    else:
        bundle.pack_part(tree, out, part, manifest, sent)


def _members(part: bundle.Entries | ranges.RangePart) -> int:
    return len(part.ranges) if isinstance(part, ranges.RangePart) else len(part)


def _start_part(plan: ExportPlan, transfer: Transfer) -> Path:
    """Where part ``plan.packed`` goes; the one two before it was sent by now and goes,
    so an export takes about three parts of disk."""
    make_folder(transfer)
    if plan.packed >= 2:
        (transfer.path / part_name(plan.packed - 2)).unlink(missing_ok=True)
    return transfer.path / part_name(plan.packed)


def _part_public(plan: ExportPlan, transfer: Transfer, out: Path) -> ExportPublic:
    return ExportPublic(
        id=transfer.label,
        key=plan.key,
        part=plan.packed - 1,
        parts=plan.count if not plan.early else plan.packed,
        path=str(out),
        bytes=out.stat().st_size,
        total_bytes=plan.total_bytes if not plan.early else transfer.nbytes,
        data_bytes=plan.data_bytes,
    )


def bundle_estimate(size_bytes: int, files: int) -> int:
    """A tar's size: data, per file a header, padding and maybe a PAX header; end blocks."""
    return size_bytes + files * 2048 + 10240
