"""One staging's job, as the scheduler hands it to its process, and the bytes and
inodes it may write (its user's quotas, the disk's floors): counted as it writes, the
staging stops itself at its room's end, and the daemon checks too.
"""

from __future__ import annotations

from collections.abc import Callable

from stager.core.settings import Settings
from stager.engine.admission import Admission, Held
from stager.engine.lifecycle import Registry
from stager.fanout.room import FanoutRoom
from stager.ops.table import OpTable
from stager.staging.blocking import Limits
from stager.staging.publish import Attempt
from stager.staging.worker import StageJob, WriteBound, past_inode_bound
from stager.state import cache
from stager.state.dataset import Entry


async def staging_job(
    entry: Entry,
    attempt: Attempt,
    settings: Settings,
    ops: OpTable,
    registry: Registry,
    admission: Admission,
    fanout: FanoutRoom,
    held: Held,
) -> tuple[StageJob, Limits]:
    """``held``: what transfers hold now. Only an adoption asks the fan-out room where
    it may read."""
    room_left, bound = await _room_left(entry, settings, registry, admission, held)
    inodes_left, inode_bound, disk_inodes = await _inodes_left(entry, settings, registry, admission)
    job = StageJob(
        steps=ops.dump_steps(entry.steps),
        op_modules=tuple(settings.op_modules),
        attempt=attempt,
        final=registry.final(entry),
        workers=settings.op_workers,
        verify=entry.verify,
        allowed_roots=fanout.staging_starts(entry)
        if entry.delivery
        else tuple(settings.allowed_roots),
        reader=entry.reader,
        nice=settings.staging_nice,
        crash_after=registry.crash.for_staging_process(),
        write_bytes=room_left,
        write_bound=bound,
        write_inodes=inodes_left,
        inode_bound=inode_bound,
        kind=registry.kinds.of(entry).job(entry),
    )
    # The staging stops itself at its room's end; the daemon checks too (a slack of
    # what one poll of its counters may see written past it).
    shared = _inodes_shared(entry, settings, registry, disk_inodes)
    limits = Limits.of(settings, room_left, bound, inodes_left, inode_bound, shared)
    return job, limits


async def _room_left(
    entry: Entry, settings: Settings, registry: Registry, admission: Admission, held: Held
) -> tuple[int | None, WriteBound]:
    """The most bytes a staging of ``entry`` may write (None: no limit) and what sets it:
    its user's quota less what their other data and transfers hold ("quota"), or the
    disk's room above its floor less what transfers were promised ("disk": a source far
    larger than it said stops there, not at a full disk)."""
    limits: list[tuple[int, WriteBound]] = []
    owner = cache.private_owner(entry)
    if owner is not None and settings.user_quota_bytes:
        others = [
            e
            for e in registry.entries.values()
            if cache.private_owner(e) == owner and e is not entry
        ]
        used = (
            cache.used_bytes(others)
            + held.reserved_by.get(owner, 0)
            + registry.held.bytes_of(owner)
        )
        limits.append((settings.user_quota_bytes - used, "quota"))
    if settings.min_free_bytes:  # no floor: the disk's own end is the limit
        room = await admission.free_bytes(held) - settings.min_free_bytes
        limits.append((room, "disk"))
    if not limits:
        return None, "quota"
    return min(limits)


async def _inodes_left(
    entry: Entry, settings: Settings, registry: Registry, admission: Admission
) -> tuple[int | None, WriteBound, int | None]:
    """:func:`_room_left` in inodes; the disk's room is also returned alone (None
    without a floor)."""
    limits: list[tuple[int, WriteBound]] = []
    owner = cache.private_owner(entry)
    if owner is not None and settings.user_inode_quota:
        used = sum(
            cache.inodes_held(e)
            for e in registry.entries.values()
            if cache.private_owner(e) == owner and e is not entry
        )
        limits.append((settings.user_inode_quota - used, "quota"))
    disk = None
    if settings.min_free_inodes:
        free = await admission.free_inodes()
        if free is not None:
            disk = free - settings.min_free_inodes
            limits.append((disk, "disk"))
    if not limits:
        return None, "quota", disk
    left, bound = min(limits)
    return left, bound, disk


def _inodes_shared(
    entry: Entry, settings: Settings, registry: Registry, disk_room: int | None
) -> Callable[[], None] | None:
    """The daemon's check of the inode bounds a staging shares with those under way:
    each was given its room counting only what the others had made by then, so
    together they could pass it. Each counts the stagings that started before it (and
    every entry not being staged), so the last to start is the one stopped. The bounds:
    its user's inode quota, and the disk's room at its start (``disk_room``)."""
    quota = settings.user_inode_quota
    owner = cache.private_owner(entry)
    mine = quota if owner is not None and quota else None
    if mine is None and disk_room is None:
        return None
    before = {e.key for e in registry.entries.values() if e.active and e is not entry}

    def counted() -> list[Entry]:
        entries = registry.entries.values()
        return [e for e in entries if not e.active or e is entry or e.key in before]

    start = sum(cache.inodes_held(e) for e in counted())

    def check() -> None:
        entries = counted()
        if mine is not None:
            own = sum(cache.inodes_held(e) for e in entries if cache.private_owner(e) == owner)
            if own > mine:
                raise past_inode_bound("quota", entry.progress.inodes_made)
        if disk_room is not None:
            if sum(cache.inodes_held(e) for e in entries) - start > disk_room:
                raise past_inode_bound("disk", entry.progress.inodes_made)

    return check
