"""`make demo-prestage`: a queued job whose data is already on its node when it starts
(pre-staging, docs/prestaging.md), on a 4-node SLURM cluster built on this machine
(deploy/slurm/multinode with MN_PRESTAGE=1; root). Takes a few minutes.

1. bring the cluster up: slurmctld doing backfill every 5 s, job_submit.lua, the
   planner (`stager plan`) beside it, node services taking its orders, the shared
   storage behind a 200 Mbit/s link,
2. put a dataset on it, and make every node busy (root's jobs; mn2's ends first),
3. a user submits a job that declares the dataset (`#STAGER`) and stages it at its
   start (`stager-client stage --from-script`): backfill plans it on mn2, the planner
   has mn2's node service stage it as that user while the job waits,
4. the same with the planner stopped: the job stages at its start,
5. print both, and take the cluster down (nothing is left behind).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from bench import prestage_jobs as pj  # noqa: E402
from bench.multinode import Cluster, ClusterError, fresh_copy, leftovers  # noqa: E402
from tests.trees import write_tree  # noqa: E402
from tests.users import made_users, usable_by_everyone  # noqa: E402

PLANNED = "mn2"


def banner(step: str) -> None:
    print(f"\n\033[1m== {step}\033[0m" if sys.stdout.isatty() else f"\n== {step}", flush=True)


def queued_job(cluster: Cluster, user: tuple[int, int], name: str, source: str, lead: int):
    """Every node busy (mn2 until ``lead`` s from now), then the user's declaring job."""
    blockers = []
    for node in cluster.nodes:
        limit, sleep = (1, lead) if node == PLANNED else (60, 3600)
        blockers.append(pj.blocker(cluster, node, limit, sleep, f"{name}-b{node}"))
    try:
        pj.wait_running(cluster, blockers)
        print(f"  every node busy; {PLANNED}'s job ends in {lead} s (the others' much later)")
        job = pj.submit_declared(cluster, user, name, source)
        print(f"  job {job} submitted, declaring:\n    {pj.declaration(name, source).strip()}")
        shown_plan = False
        while (info := cluster.job(job)).get("JobState") == "PENDING":
            planned = info.get("SchedNodeList", "(null)")
            if planned != "(null)" and not shown_plan:
                print(f"  backfill plans it on {planned} at {info.get('StartTime')}")
                shown_plan = True
            time.sleep(0.5)
        run = pj.follow(cluster, job, name)
    finally:
        pj.cancel(cluster, blockers)
    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=100, help="size of the dataset (default 100)")
    parser.add_argument("--lead", type=int, default=40, help="seconds the job is queued")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("demo-prestage needs root: it builds namespaces, mounts, users and runs slurmd")
        return 2

    banner("1/5 a 4-node SLURM cluster with pre-staging (deploy/slurm/multinode, MN_PRESTAGE=1)")
    cluster = Cluster(nodes=4, rate="200mbit", local_size="1g", prestage=True)
    with made_users() as (alice, _), usable_by_everyone():
        try:
            cluster.up()
        except ClusterError as exc:
            print(f"the cluster could not start: {exc}")
            return 1
        rows = []
        try:
            cluster.jobs_dir.chmod(0o1777)
            user = (alice.uid, alice.gid)
            banner(f"2/5 a {args.mb} MB image folder on the shared storage; user {alice.name}")
            tree = write_tree(cluster.storage_dir / "imgs", n_files=args.mb * 10, max_size=200_000)
            for path in [tree, *tree.rglob("*")]:
                path.chmod(0o755 if path.is_dir() else 0o644)
            for step, on in (("3/5", True), ("4/5", False)):
                cluster.planner("start" if on else "stop")
                banner(f"{step} a queued job, the planner {'running' if on else 'STOPPED'}")
                source = cluster.shared(fresh_copy(tree, "on" if on else "off"))
                before = cluster.storage()
                run = queued_job(cluster, user, f"demo-{'on' if on else 'off'}", source, args.lead)
                moved = (cluster.storage() - before).content / 1e6
                if not run.ok:
                    print(f"  the job failed:\n{run.output}")
                    return 1
                print(f"  it ran on {run.ran_on}; its staging at start: {run.hows[0]}, "
                      f"{run.seconds:.2f} s from its start to its data ready")  # fmt: skip
                rows.append((on, run, moved))
            banner("5/5 figures")
            print(f"storage link 200 Mbit/s; load {os.getloadavg()[0]:.1f} on {os.cpu_count()} "
                  "cores")  # fmt: skip
            print(f"{'pre-staging':<12} {'node':>5} {'at start':>9} {'start -> ready':>15} "
                  f"{'storage read':>13}")  # fmt: skip
            for on, run, moved in rows:
                print(f"{'on' if on else 'off':<12} {run.ran_on:>5} {run.hows[0]:>9} "
                      f"{run.seconds:>13.2f} s {moved:>10.0f} MB")  # fmt: skip
        finally:
            namespaces = cluster.namespaces
            cluster.down()
            left = leftovers(namespaces)
            print(
                "\ncluster down" + (f"; LEFT BEHIND: {left}" if left else ", nothing left behind")
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
