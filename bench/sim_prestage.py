"""What pre-staging buys and costs, against how often Slurm's plan is right.

A Monte Carlo model of the planner (docs/prestaging.md), not a measurement. Each job:
- waits in the queue W (lognormal, median 1 h) and stages S seconds of data
  (uniform 1-10 min, at the storage's rate, so bytes are proportional to seconds);
- gets its first plan at the first backfill cycle (<= 30 s), and its prefetch starts
  at the first planner interval (30 s) once its planned start is within the horizon
  (30 min): a lead of up to 30 min;
- its plan moves before it starts a Poisson number of times (mean 0.5 within the
  horizon): each move re-targets, wasting what was fetched on the old node;
- with probability ``p`` it starts on the nodes last planned; the data fetched by
  then is hidden (staging seconds the job does not wait); otherwise it starts
  elsewhere, stages as without pre-staging, and what was fetched is wasted;
- it starts earlier than planned half the time (a running job ended early), by an
  exponential time (mean 10 min), which shortens the lead (Brown et al. 2022: Slurm's
  start estimates are within a minute for only 4-17% of jobs; the lead needs to
  exceed S, not to be exact).

    python -m bench.sim_prestage [--jobs 20000] [--seed 1]
"""

from __future__ import annotations

import argparse
import math
import random
from dataclasses import dataclass

HORIZON_S = 1800.0
INTERVAL_S = 30.0
MOVES_MEAN = 0.5
EARLY_MEAN_S = 600.0


@dataclass
class Outcome:
    staging_s: float = 0.0  # what every job would wait without pre-staging
    hidden_s: float = 0.0  # of which pre-staging hid
    fetched_s: float = 0.0  # prefetched, in staging seconds (proportional to bytes)
    wasted_s: float = 0.0  # prefetched and never used


def poisson(rng: random.Random, mean: float) -> int:
    limit, k, product = math.exp(-mean), 0, rng.random()
    while product > limit:
        k += 1
        product *= rng.random()
    return k


def one_job(rng: random.Random, p: float, out: Outcome) -> None:
    staging = rng.uniform(60, 600)
    wait = rng.lognormvariate(math.log(3600), 1.2)
    planned_at = rng.uniform(0, INTERVAL_S)  # first backfill cycle
    early = rng.expovariate(1 / EARLY_MEAN_S) if rng.random() < 0.5 else 0.0
    # The planner sees the planned start within the horizon at its next interval.
    lead = max(0.0, min(wait - planned_at, HORIZON_S) - rng.uniform(0, INTERVAL_S))
    lead = max(0.0, lead - early)  # it started sooner than planned
    out.staging_s += staging
    for _ in range(poisson(rng, MOVES_MEAN)):  # re-targets: fetched so far is lost
        moved_at = rng.uniform(0, lead)
        fetched = min(moved_at, staging)
        out.fetched_s += fetched
        out.wasted_s += fetched
        lead -= moved_at
    fetched = min(lead, staging)
    out.fetched_s += fetched
    if rng.random() < p:
        out.hidden_s += fetched
    else:
        out.wasted_s += fetched


def simulate(p: float, jobs: int, seed: int) -> Outcome:
    rng, out = random.Random(seed), Outcome()
    for _ in range(jobs):
        one_job(rng, p, out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=20_000, help="jobs per point (20000)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    print("plan right | staging time hidden | bytes wasted / prefetched | wasted / needed")
    for percent in range(10, 100, 10):
        out = simulate(percent / 100, args.jobs, args.seed)
        print(
            f"{percent:9d}% | {out.hidden_s / out.staging_s:18.0%} | "
            f"{out.wasted_s / out.fetched_s:25.0%} | {out.wasted_s / out.staging_s:14.0%}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
