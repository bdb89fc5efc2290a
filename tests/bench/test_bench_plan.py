"""bench_plan's queue is what the planner reads, and it holds the planner to one
squeue call per interval; the simulation's figures move the right way with p."""

from __future__ import annotations

from bench import bench_plan, sim_prestage
from stager.prestage.plan import squeue


def test_the_synthetic_queue_reads_without_a_problem_and_plans_jobs() -> None:
    text = bench_plan.synthetic_queue(2000, 200, seed=1)
    jobs, problems = squeue.parse(text)
    assert not problems and len(jobs) == 2200
    assert {job.state for job in jobs} == {"PENDING", "RUNNING"}


def test_a_small_run_meets_its_targets(capsys) -> None:
    # The median of three: one sample on a loaded machine can be three times the rest.
    assert bench_plan.main(["--pending", "1000", "--nodes", "100", "--repeat", "3"]) == 0
    assert "squeue calls: 9 for 9 intervals (1 per interval)" in capsys.readouterr().out


def test_more_right_plans_hide_more_and_waste_less() -> None:
    low, high = (sim_prestage.simulate(p, 3000, seed=2) for p in (0.2, 0.8))
    assert high.hidden_s > low.hidden_s and high.wasted_s < low.wasted_s
