"""The cache policy: what must be evicted for a new staging to fit, in one place.

A request's estimate must fit under ``capacity_bytes`` and leave ``min_free_bytes``
free once every staging under way has written what it still has to; else ready
entries nobody holds are evicted least recently used first, or the request fails at
once with a sentence giving the sizes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from stager.core.errors import InsufficientSpace, QuotaExceeded
from stager.core.settings import format_size as human
from stager.state.dataset import Entry
from stager.wire.schemas import State


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
    """A ready tree its seal's entries, an image its file, a staging what it made so far."""
    if entry.state == State.READY:
        return entry.seal.entries if entry.seal is not None else 1
    return entry.progress.inodes_made if entry.active else 0


# The inodes admission makes room for before a staging starts: how many it makes is not
# known until it runs, so each is given this much, and stopped at its bound past it.
ADMIT_INODES = 1024


def plan_inodes(must_free: int, candidates: list[Entry]) -> list[Entry]:
    """The least recently used of ``candidates`` whose inodes add up to ``must_free``;
    none when they cannot (the staging is stopped at its bound: evicting others for it
    would lose their data for nothing)."""
    plan, freed = _oldest_first(candidates, must_free, inodes_held)
    return plan if freed >= must_free else []


def pending_bytes(entries: Iterable[Entry]) -> int:
    """Bytes admitted stagings have still to write, from each one's progress fraction."""
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
    """The uid whose own copy an entry is (node service); None: shared, or per-user."""
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
    their quota; raises if they cannot. ``still_held``: their evicted datasets' space
    still held, which no eviction frees."""
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
    ``still_held`` is on its owners' quotas, not the capacity (or one user's open files
    would evict others' data), and is named in the refusal."""
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


def _oldest_first(
    candidates: list[Entry], must_free: int, size: Callable[[Entry], int] = lambda e: e.size_bytes
) -> tuple[list[Entry], int]:
    """The first of ``candidates`` that free ``must_free`` (or all), and what they free."""
    plan, freed = [], 0
    for entry in candidates:
        if freed >= must_free:
            break
        plan.append(entry)
        freed += size(entry)
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
