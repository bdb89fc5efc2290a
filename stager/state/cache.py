"""The cache policy: what must be evicted for a new staging to fit, in one place.

Admission happens before staging: the request's estimated size must fit under
the byte limit (``capacity_bytes``) and leave ``min_free_bytes`` free on the
cache filesystem once every staging under way has written what it still has
to. If it does not, ready entries are evicted least-recently-used first. Never
evicted: leased entries, entries being staged, and entries a live request is
using (the engine decides under one lock). If even evicting every candidate is
not enough, the request fails at once with a sentence giving the sizes.
"""

from __future__ import annotations

from collections.abc import Iterable

from stager.core.errors import InsufficientSpace, QuotaExceeded
from stager.state.dataset import Entry
from stager.wire.schemas import State


def human(nbytes: int) -> str:
    """Sizes in sentences: 512 B, 3.4 MiB, 1.20 TiB."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"


def used_bytes(entries: Iterable[Entry]) -> int:
    """Bytes the cache holds or has promised: ready sizes plus estimates of active stagings."""
    total = 0
    for entry in entries:
        if entry.state == State.READY:
            total += entry.size_bytes
        elif entry.active:
            total += entry.estimate_bytes
    return total


def inodes_held(entry: Entry) -> int:
    """Inodes an entry holds on the cache's disk: a ready tree its seal's entries, an
    image its file, a staging what it has made so far."""
    if entry.state == State.READY:
        return entry.seal.entries if entry.seal is not None else 1
    return entry.progress.inodes_made if entry.active else 0


# The inodes admission makes room for above a user's inode quota or the disk's inode
# floor, before a staging starts: how many it will make is not known until it runs (an
# archive's members are not listed before it is read), so each is given this much, and
# one that makes more is stopped at its bound (stager.staging.worker.past_inode_bound).
ADMIT_INODES = 1024


def plan_inodes(must_free: int, candidates: list[Entry]) -> list[Entry]:
    """The least recently used of ``candidates`` (:func:`evictable`) whose inodes
    (:func:`inodes_held`) add up to ``must_free``; none when they cannot: a staging with
    less room than it asked for is stopped at its bound, and evicting others for it
    would lose their data for nothing."""
    plan, freed = [], 0
    for entry in candidates:
        if freed >= must_free:
            break
        plan.append(entry)
        freed += inodes_held(entry)
    return plan if freed >= must_free else []


def pending_bytes(entries: Iterable[Entry]) -> int:
    """Bytes that stagings under way have still to write: already admitted, but not yet
    missing from the disk's free space. Estimated from each one's progress fraction."""
    total = 0
    for entry in entries:
        if entry.active:
            done, of = entry.progress.bytes_done, entry.progress.bytes_total
            fraction = min(1.0, done / of) if of else 0.0
            total += int(entry.estimate_bytes * (1.0 - fraction))
    return total


def evictable(entries: Iterable[Entry], protected: set[str]) -> list[Entry]:
    """Ready entries nobody holds, least recently used first."""
    candidates = [e for e in entries if e.state == State.READY and e.key not in protected]
    return sorted(candidates, key=lambda e: e.last_used_at)


def private_owner(entry: Entry) -> int | None:
    """The uid whose own copy an entry is, in the node service; None for one shared by
    every user, and for every entry of a per-user daemon."""
    reader = entry.reader
    return reader.uid if reader is not None and not reader.public else None


def plan_quota(
    needed: int,
    owner: int,
    entries: list[Entry],
    protected: set[str],
    quota_bytes: int,
    still_held: int = 0,
) -> list[Entry]:
    """The owner's own entries to evict so that ``needed`` more private bytes stay within
    their quota (shared entries count against nobody's); raises if they cannot.
    ``still_held``: what the owner's evicted datasets still hold (stager.engine.held_space),
    counted and never freed by an eviction."""
    own = [e for e in entries if private_owner(e) == owner]
    must_free = used_bytes(own) + still_held + needed - quota_bytes
    if must_free <= 0:
        return []
    plan, freed = _oldest_first(evictable(own, protected), must_free)
    if freed < must_free:
        held = (
            f"; {human(still_held)} more is still held by your processes in datasets that "
            "were deleted (a shell or program whose folder is in a deleted image dataset, "
            "or that keeps a deleted dataset's file open; lsof +L1 lists open deleted "
            "files): it is freed, and leaves your quota, once they leave those folders "
            "and close those files"
            if still_held
            else ""
        )
        raise QuotaExceeded(
            f"this needs about {human(needed)} of your own (data not everyone may read, and "
            f"the room your fan-out transfers hold, count against your quota of "
            f"{human(quota_bytes)}), and you hold "
            f"{human(used_bytes(own))} of which evicting your unleased datasets frees only "
            f"{human(freed)}{held}; release your leases, delete datasets you no longer need, "
            "or ask the admin for a larger --user-quota"
        )
    return plan


def plan_admission(
    needed: int,
    entries: list[Entry],
    protected: set[str],
    capacity_bytes: int,
    free_bytes: int,
    min_free_bytes: int,
    still_held: int = 0,
) -> list[Entry]:
    """Entries to evict so that ``needed`` more bytes fit; raises if they cannot.
    ``still_held``: what evicted datasets still hold, missing from ``free_bytes`` and
    never freed by an eviction; each is on its owner's quota, not on the capacity (or
    one user's open files would evict others' data), and is named in the refusal."""
    over_capacity = max(0, used_bytes(entries) + needed - capacity_bytes) if capacity_bytes else 0
    over_disk = max(0, needed + pending_bytes(entries) + min_free_bytes - free_bytes)
    must_free = max(over_capacity, over_disk)
    if must_free == 0:
        return []
    plan, freed = _oldest_first(evictable(entries, protected), must_free)
    if freed < must_free:
        raise InsufficientSpace(
            _refusal(needed, entries, protected, capacity_bytes, free_bytes, min_free_bytes, freed)
            + _held(still_held)
        )
    return plan


def _oldest_first(candidates: list[Entry], must_free: int) -> tuple[list[Entry], int]:
    """The least recently used of ``candidates`` that free ``must_free`` bytes (or all
    of them, if they cannot), and what they free."""
    plan, freed = [], 0
    for entry in candidates:
        if freed >= must_free:
            break
        plan.append(entry)
        freed += entry.size_bytes
    return plan, freed


def _held(still_held: int) -> str:
    if not still_held:
        return ""
    return (
        f" ({human(still_held)} of the disk is still held by processes in datasets that were "
        "deleted, and is freed when they leave them)"
    )


def _refusal(
    needed: int,
    entries: list[Entry],
    protected: set[str],
    capacity: int,
    free: int,
    min_free: int,
    evictable_bytes: int,
) -> str:
    limit = (
        f"a cache limit of {human(capacity)} with {human(used_bytes(entries))} in use, "
        if capacity
        else ""
    )
    held = sum(e.size_bytes for e in entries if e.key in protected and e.state == State.READY)
    pending = pending_bytes(entries)
    promised = f"{human(pending)} of it promised to stagings under way; " if pending else ""
    return (
        f"staging needs about {human(needed)} but there is {limit}{human(free)} free on the disk "
        f"({promised}keeping {human(min_free)} in reserve), "
        "and evicting every unleased dataset frees only "
        f"{human(evictable_bytes)} ({human(held)} is leased or in use); release leases, raise "
        "--capacity-bytes, or point --cache-dir at a larger disk"
    )
