"""`make demo-multinode`: one dataset staged on every node of a 4-node SLURM job while
the shared storage is read once (fan-out over sbcast), on a test cluster built on this
machine (deploy/slurm/multinode; root). Takes a couple of minutes.

1. bring the cluster up: 4 nodes, each with its own local disk; the shared storage
   behind a 200 Mbit/s link, its bytes counted on the storage side,
2. put a dataset on it: a folder of class folders, and the same as a .tar.gz,
3. for each: a 1-node job, then a 4-node job, each running
   `stager-client stage ... --recipe imagefolder --peers slurm`,
4. a 4-node job for data that one node (not the first) already holds: 0 bytes,
5. print the figures and take the cluster down (nothing is left behind).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from bench.multinode import Cluster, ClusterError, fresh_copy, leftovers  # noqa: E402
from tests.trees import make_tar, write_tree  # noqa: E402


def banner(step: str) -> None:
    print(f"\n\033[1m== {step}\033[0m" if sys.stdout.isatty() else f"\n== {step}", flush=True)


def stage(cluster: Cluster, name: str, source: str, nodes: int, extra: list[str] | None = None):
    script = (
        f"stager-client stage {name} --recipe imagefolder --source {source} --peers slurm "
        f"--timeout 600 --json > $PWD/{name}.json\n"
    )
    before = cluster.storage()
    job = cluster.sbatch(script, nodes=nodes, name=name, timeout=900, extra=extra)
    moved = cluster.storage() - before
    report_file = cluster.jobs_dir / f"{name}.json"
    if not job.ok or not report_file.exists():
        raise SystemExit(f"job {job.job_id} {job.state}:\n{job.output}")
    report = json.loads(report_file.read_text())
    for node, result in sorted(report["nodes"].items()):
        how = result["how"] if not result["error"] else f"FAILED: {result['error']}"
        print(f"  {node}: {how}")
    return report, moved


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=60, help="size of the dataset (default 60)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("demo-multinode needs root: it builds namespaces, mounts and runs slurmd")
        return 2

    banner("1/5 a 4-node SLURM cluster on this machine (deploy/slurm/multinode/up.sh)")
    cluster = Cluster(nodes=4, rate="200mbit", local_size="1g")
    try:
        cluster.up()
    except ClusterError as exc:
        print(f"the cluster could not start: {exc}")
        return 1
    rows = []
    try:
        banner(f"2/5 a {args.mb} MB image folder and its .tar.gz on the shared storage")
        count = args.mb * 10
        tree = write_tree(cluster.storage_dir / "imgs", n_files=count, max_size=200_000)
        archive = make_tar(tree, cluster.storage_dir / "imgs.tar.gz", arcname=".")
        sizes = {
            "tree": sum(p.stat().st_size for p in tree.rglob("*") if p.is_file()),
            "tar.gz": archive.stat().st_size,
        }
        for kind, path in (("tree", tree), ("tar.gz", archive)):
            banner(f"3/5 the {kind}: 1 node, then 4 nodes with fan-out")
            for nodes in (1, 4):
                # A path of its own per job: a new cache key, so each starts cold.
                copy = fresh_copy(path, f"n{nodes}")
                name = f"{kind.replace('.', '')}-n{nodes}"
                report, moved = stage(cluster, name, cluster.shared(copy), nodes)
                rows.append((kind, nodes, report, moved.content / sizes[kind]))

        banner("4/5 4 nodes, and node mn3 already holds the tree")
        held = fresh_copy(tree, "held")
        stage(cluster, "held-n1", cluster.shared(held), 1, extra=["--nodelist=mn3"])
        report, moved = stage(cluster, "held-n4", cluster.shared(held), 4)
        rows.append(("tree, held by mn3", 4, report, moved.content / sizes["tree"]))

        banner("5/5 figures")
        print(f"storage link 200 Mbit/s; bytes counted by the storage's own server; load "
              f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")  # fmt: skip
        print(f"{'dataset':<18} {'nodes':>5} {'mode':>8} {'ready on all':>13} {'storage/src':>12}")
        for kind, nodes, report, ratio in rows:
            print(f"{kind:<18} {nodes:>5} {report['mode']:>8} {report['seconds']:>11.1f} s "
                  f"{ratio:>11.2f}x")  # fmt: skip
    finally:
        namespaces = cluster.namespaces
        cluster.down()
        left = leftovers(namespaces)
        print("\ncluster down" + (f"; LEFT BEHIND: {left}" if left else ", nothing left behind"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
