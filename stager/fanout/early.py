"""Early parts: files a staging finished, sent to the other nodes while it stages the
rest, so the send overlaps the storage read (docs/multinode.md, "early parts").

A file is finished once its ctime is ``STABLE_S`` old (the kernel sets ctime, and no
call sets it back), and is remembered with its identity as it was before it was read.
The ready tree is walked again at the end: a file with another identity goes in the
final parts, and the receivers check everything against the ready tree's manifest:
sending early is never trusted, only faster.
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

from stager.archive import ranges
from stager.fanout.bundle import Entries, cut
from stager.fs.manifest import Digests, walk
from stager.wire.manifest_format import Manifest

# A file unchanged this long is taken to be finished (a wrong guess costs a resend).
STABLE_S = 0.5
# A ctime of whole seconds may come from a filesystem that keeps no finer time (ext4
# with small inodes, some network mounts; 2 s on FAT): a write later in the same
# second or two would leave it as it is, so such a file waits that much longer.
COARSE_S = 2.0
# Early parts hold about a sixteenth of the staging's estimate (or size, once known),
# within bounds: a small dataset still goes in a few parts, a large one in parts whose
# sbcast costs little next to their size.
MIN_PART_BYTES = 1 << 20
PARTS_PER_ESTIMATE = 16
# Between two looks at a staging tree: at least this, and a few times what a walk of
# it took (a tree of a million files is not walked twice a second beside its staging).
RETRY_MIN_S = 0.25
RETRY_WALKS = 4


def part_bytes_for(estimate_bytes: int, largest: int) -> int:
    """The part size of an early export of a staging estimated at ``estimate_bytes``."""
    return max(MIN_PART_BYTES, min(largest, estimate_bytes // PARTS_PER_ESTIMATE))


def settled(info: os.stat_result, now: float) -> bool:
    """Whether nothing changed the file for ``STABLE_S``, in a way that any change
    after ``now`` moves its ctime."""
    coarse = info.st_ctime_ns % 1_000_000_000 == 0
    return now - info.st_ctime >= STABLE_S + (COARSE_S if coarse else 0.0)


def pick(
    tree: Path,
    sent: Digests,
    sent_dirs: set[str],
    part_bytes: int,
    now: float,
    growing: dict[int, ranges.Growing] | None = None,
    scratch: frozenset[str] = frozenset(),
) -> tuple[Entries | ranges.RangePart | None, float]:
    """The next early part of staging ``tree`` (None: not ``part_bytes`` yet) and how
    long to wait before the next look: whole entries (new folders, settled files not
    sent as they are now), or with ``growing`` ranges of files still written and the
    ends of those settled since. Files in ``scratch`` (the staging removes them) never go."""
    started = time.monotonic()
    entries: Entries = []
    ranged = ranges.RangePart()
    held = ranges.booked_paths(growing) if growing is not None else {}
    size = 0
    for path, info in walk(tree):
        if stat.S_ISDIR(info.st_mode):
            if path not in sent_dirs:
                entries.append((path, info))
            continue
        if not stat.S_ISREG(info.st_mode) or path in scratch:
            continue
        done = settled(info, now)
        known = sent.known(path, info) is not None  # went as it is now
        book = growing.get(info.st_ino) if growing is not None else None
        if growing is not None and (
            book is not None or (not done and info.st_size >= part_bytes and not known)
        ):
            # Sent in ranges (once its last range went and it is unchanged: nothing).
            if not known and ranged.nbytes < part_bytes:
                room = part_bytes - ranged.nbytes
                piece = ranges.next_range(tree, path, info, book, room, done, held)
                if piece is not None:
                    ranged.ranges.append(piece)
        elif done and not known and size < part_bytes:
            entries.append((path, info))
            size += info.st_size
        if size >= part_bytes and (growing is None or ranged.nbytes >= part_bytes):
            break
    retry = max(RETRY_MIN_S, RETRY_WALKS * (time.monotonic() - started))
    if ranged.nbytes >= part_bytes or any(piece.last for piece in ranged.ranges):
        ranged.ranges = ranges.in_order(ranged.ranges)
        return ranged, retry
    return (entries if size >= part_bytes else None), retry


def rest(
    tree: Path, sent: Digests, part_bytes: int, growing: dict[int, ranges.Growing] | None = None
) -> tuple[list[Entries | ranges.RangePart], Manifest, int]:
    """What the ready ``tree`` still needs sent after the early parts (the ends of files
    sent in ranges, found by inode; then everything not sent as it is now), the
    manifest of what was already sent, and the tree's file bytes."""
    manifest = Manifest()
    needed: Entries = []
    ends: list[tuple[str, os.stat_result, ranges.Growing]] = []
    growing = dict(growing or {})
    held = ranges.booked_paths(growing)
    data_bytes = 0
    for path, info in walk(tree):
        if stat.S_ISREG(info.st_mode):
            data_bytes += info.st_size
            if (digest := sent.known(path, info)) is not None:
                manifest.files[path] = digest
                continue
            if (book := growing.pop(info.st_ino, None)) is not None:
                ranges.confirm(tree, path, info, book)  # changed behind its ranges: again
                ends.append((path, info, book))
                continue
        needed.append((path, info))
    parts: list[Entries | ranges.RangePart] = [*ranges.cut(ends, part_bytes, held)]
    if needed or not parts:  # a part of nothing only when nothing else is left to send
        parts.extend(cut(needed, part_bytes))
    return parts, manifest, data_bytes
