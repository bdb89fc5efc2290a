"""The prefetches a node holds for jobs, their budgets, and the file that keeps them.

A prefetch is ``active`` until it is ``used``, ``wasted`` or ``failed``; only active
ones count against the budgets. Ended ones are kept until ``prefetch_expire_s`` after
their start, so that the job's status can still say it was pre-staged.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from stager.core.errors import TooManyRequests
from stager.core.settings import Settings
from stager.prestage import write_private


@dataclass
class Prefetch:
    job: int
    uid: int
    gid: int
    dataset: str  # the declared name
    name: str  # the prefetch's own name among the user's datasets
    key: str
    bytes: int  # its size once ready, its estimate before
    started_at: float  # epoch seconds
    state: str = "active"  # active, used, wasted, failed
    source: str = ""  # a copy's source node (stager.ops.copy_from_node); "": the storage


def prefetch_name(job: int, dataset: str) -> str:
    """The prefetch's own name: the user sees it in ``stager-client ls``; their job's
    request names the dataset as declared, and its name stays theirs."""
    return f"prefetch-{job}-{dataset}"[:128]


class Book:
    def __init__(self, prefetches: list[Prefetch] | None = None) -> None:
        self.prefetches: dict[tuple[int, str], Prefetch] = {
            (p.job, p.dataset): p for p in prefetches or []
        }
        # Budget taken by prefetches admitted and not in the book yet: (uid, bytes).
        self.reserved: dict[object, tuple[int, int]] = {}

    def active(self) -> list[Prefetch]:
        return [p for p in self.prefetches.values() if p.state == "active"]

    def of_job(self, job: int) -> list[Prefetch]:
        return [p for p in self.prefetches.values() if p.job == job]

    def waiting_for(self, uid: int, key: str) -> list[Prefetch]:
        """Active prefetches of ``uid``'s jobs for the data of ``key``."""
        return [p for p in self.active() if (p.uid, p.key) == (uid, key)]

    def job_for(self, uid: int, key: str) -> int | None:
        """The job for which ``uid``'s data of ``key`` was pre-staged here, if any."""
        found = [p for p in self.prefetches.values() if (p.uid, p.key) == (uid, key)]
        return max(found, key=lambda p: p.started_at).job if found else None

    def check_budget(self, uid: int, more: int, settings: Settings) -> None:
        """Refuse ``more`` bytes prefetched for ``uid`` past their budget or the node's."""
        held = [(p.uid, p.bytes) for p in self.active()] + list(self.reserved.values())
        mine = sum(size for owner, size in held if owner == uid)
        everyone = sum(size for _, size in held)
        user_budget, node_budget = (
            settings.prefetch_user_budget_bytes,
            settings.prefetch_node_budget_bytes,
        )
        if mine + more > user_budget:
            raise TooManyRequests(
                f"uid {uid} has {mine} bytes prefetched here for jobs not started, and this "
                f"one needs {more}: past the user's budget ({user_budget}, "
                "STAGER_PREFETCH_USER_BUDGET_BYTES); the job stages when it starts"
            )
        if everyone + more > node_budget:
            raise TooManyRequests(
                f"this node has {everyone} bytes prefetched for jobs not started, and this "
                f"one needs {more}: past the node's budget ({node_budget}, "
                "STAGER_PREFETCH_NODE_BUDGET_BYTES); the job stages when it starts"
            )

    def forget_before(self, when: float) -> None:
        """Drop the records of ended prefetches started before ``when``."""
        self.prefetches = {
            k: p for k, p in self.prefetches.items() if p.state == "active" or p.started_at >= when
        }


def load(path: Path) -> tuple[Book, dict[str, float]]:
    """The book and the used credentials saved at ``path`` (none when it does not exist)."""
    try:
        saved = json.loads(path.read_text())
    except FileNotFoundError:
        return Book(), {}
    book = Book([Prefetch(**p) for p in saved.get("prefetches", [])])
    return book, {str(d): float(t) for d, t in saved.get("seen", {}).items()}


def save(path: Path, book: Book, seen: dict[str, float]) -> None:
    """Write both at once, durably: a credential counts as used once this returns."""
    text = json.dumps({"prefetches": [asdict(p) for p in book.prefetches.values()], "seen": seen})
    write_private(path, text)
