"""One planning interval: one squeue call, the plan, the changes since the last one."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from stager.prestage.plan import changes, planning, squeue
from stager.prestage.plan.declared import Declarations


@dataclass
class Interval:
    plan: planning.Plan
    changes: changes.Changes
    problems: list[str]  # squeue lines that could not be read
    now: datetime


class Planner:
    def __init__(
        self,
        source: squeue.Squeue,
        horizon_s: float,
        clock: Callable[[], datetime] = datetime.now,  # naive local time, as squeue prints
        targets_max: int | None = None,
    ) -> None:
        self.source = source
        self.horizon_s = horizon_s
        self.targets_max = targets_max
        self.clock = clock
        self.declarations = Declarations()
        self.previous: frozenset[planning.Prefetch] = frozenset()
        self.lines: dict[str, squeue.QueuedJob] = {}  # the last interval's, as read

    def interval(self) -> Interval:
        jobs, problems = squeue.parse(self.source.read(), self.lines)
        now = self.clock()
        plan = planning.compute(jobs, now, self.horizon_s, self.declarations, self.targets_max)
        found = changes.diff(self.previous, plan)
        self.previous = plan.prefetches | frozenset(found.held)
        return Interval(plan, found, problems, now)

    def forget(self, prefetch: planning.Prefetch) -> None:
        """``prefetch`` did not reach its node: the next interval finds it new again."""
        self.previous = self.previous - {prefetch}
