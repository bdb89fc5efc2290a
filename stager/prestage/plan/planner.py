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
        self._again: set[planning.Prefetch] = set()  # delivered, asked again (``again``)

    def interval(self) -> Interval:
        jobs, problems = squeue.parse(self.source.read(), self.lines)
        now = self.clock()
        plan = planning.compute(jobs, now, self.horizon_s, self.declarations, self.targets_max)
        found = changes.diff(self.previous, plan)
        found.start += sorted((self._again & plan.prefetches) - set(found.start))
        self._again = set()
        self.previous = plan.prefetches | frozenset(found.held)
        return Interval(plan, found, problems, now)

    def forget(self, prefetch: planning.Prefetch) -> None:
        """``prefetch`` did not reach its node: the next interval finds it new again."""
        self.previous = self.previous - {prefetch}

    def again(self, prefetch: planning.Prefetch) -> None:
        """``prefetch`` reached its node, which stages it still: sent again next interval
        while it is planned (the answer says whether it is ready), and known meanwhile,
        so that its job moving or leaving cancels it there."""
        self._again.add(prefetch)
