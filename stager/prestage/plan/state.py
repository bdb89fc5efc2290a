"""The planner's state across its restarts: the last interval's prefetch set and the
cancels not yet delivered, in one small JSON file (``plan_state_path``), written
atomically after each interval that changed them.

Without it, a restarted planner knows nothing of what it ordered: the prefetches of
jobs that left while it was down would stay on their nodes until they expire
(``prefetch_expire_s``). With it, its first interval diffs the queue against the last
plan and cancels them. A state that cannot be read or written costs only that: it is
logged, and planning goes on.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from stager.prestage.plan.declared import Wanted
from stager.prestage.plan.planning import Prefetch

log = logging.getLogger("stager.prestage.plan")

# A cancel not delivered yet: (node, the order's body, its job).
Cancel = tuple[str, str, str]


def load(path: Path) -> tuple[frozenset[Prefetch], list[Cancel]]:
    try:
        saved = json.loads(path.read_text())
        previous = frozenset(
            Prefetch(
                p["job"],
                p["node"],
                p["uid"],
                p["gid"],
                Wanted(p["name"], p["body"]),
                p.get("source", ""),
            )  # fmt: skip
            for p in saved["prefetches"]
        )
        cancels = [(c["node"], c["body"], c["job"]) for c in saved["cancels"]]
    except FileNotFoundError:
        return frozenset(), []
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("%s: the last plan cannot be read (%s); starting without it", path, exc)
        return frozenset(), []
    return previous, cancels


def save(path: Path, previous: frozenset[Prefetch], cancels: list[Cancel]) -> None:
    text = json.dumps(
        {
            "prefetches": [
                {"job": p.job_id, "node": p.node, "uid": p.uid, "gid": p.gid,
                 "name": p.wanted.name, "body": p.wanted.body, "source": p.source}
                for p in sorted(previous)
            ],
            "cancels": [{"node": n, "body": b, "job": j} for n, b, j in cancels],
        }
    )  # fmt: skip
    partial = path.with_name(path.name + ".partial")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(text.encode())
            out.flush()
            os.fsync(out.fileno())
        os.replace(partial, path)
    except OSError as exc:
        log.warning(
            "%s: the plan cannot be kept (%s); a restarted planner will not cancel the "
            "prefetches of jobs that leave meanwhile (STAGER_PLAN_STATE)",
            path, exc.strerror or exc,
        )  # fmt: skip
