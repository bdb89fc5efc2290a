"""The planner's state across its restarts: the last interval's prefetch set and the
cancels not yet delivered (``plan_state_path``), so that a restarted planner cancels
the prefetches of jobs that left while it was down. A state that cannot be read or
written is logged, and planning goes on.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from stager.prestage import write_private
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
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_private(path, text)
    except OSError as exc:
        log.warning(
            "%s: the plan cannot be kept (%s); a restarted planner will not cancel the "
            "prefetches of jobs that leave meanwhile (STAGER_PLAN_STATE)",
            path, exc.strerror or exc,
        )  # fmt: skip
