"""Pre-staging on the 4-node test cluster (deploy/slurm/multinode, ``MN_PRESTAGE=1``): a
real slurmctld doing backfill every 5 s, the planner (`stager plan`) in the root
namespace, node services taking its orders, the shared storage behind a --rate link.
Pre-staging on and off side by side in one run (off: the planner stopped), median of
--runs; every job is a real user's, declaring one dataset of --mb MB (an imagefolder
tree) with a ``#STAGER`` line and staging it at its start with
``stager-client stage --from-script``; every run on a fresh copy (a new cache key).

- ``hit``: a 1-node job queued behind a blocker on one node (the others busy for
  longer), so backfill plans it there; the blocker ends --lead s after the job's
  submit. Seconds from the job's start to its data ready, whether it hit, and the
  bytes that left the storage while it was queued and ran.
- ``4-node``: a 4-node job queued behind a blocker on every node.
- ``wrong``: a 1-node job planned on one node, whose blocker ends first on another
  (its job "ended early"), so it starts there; the prefetch on the planned node is
  wasted, and shows in that node's metrics.
- ``placement``: --tries times, one node (never the first, Slurm's default pick) holds
  a dataset (--placement-mb), every node is free, and a job declaring that dataset is
  submitted: where it starts, and whether it hits.

    sudo .venv/bin/python -m bench.bench_prestage                      # 200 MB, 200 Mbit/s
    sudo .venv/bin/python -m bench.bench_prestage --mb 20 --runs 1 --tries 2 --lead 30
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import prestage_jobs as pj  # noqa: E402
from bench.multinode import Cluster, fresh_copy, leftovers  # noqa: E402
from stager.prestage.placement.names import feature  # noqa: E402
from tests.users import made_users, usable_by_everyone  # noqa: E402

FILE_BYTES = 500_000  # about a JPEG of ImageNet's larger ones; 400 files per 200 MB
CLASSES = 10


def make_tree(root: Path, total: int) -> Path:
    for i in range(max(1, total // FILE_BYTES)):
        path = root / f"class_{i % CLASSES:02d}" / f"img_{i:06d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(FILE_BYTES))
    for path in [root, *root.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return root


def tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


class Bench:
    def __init__(self, cluster: Cluster, user: tuple[int, int], args: argparse.Namespace):
        self.cluster = cluster
        self.user = user
        self.args = args
        self.tree = make_tree(cluster.storage_dir / "imgs", args.mb * 10**6)
        self.size = tree_bytes(self.tree)
        self.small = make_tree(cluster.storage_dir / "small", args.placement_mb * 10**6)
        self.count = 0

    def fresh(self, tag: str, tree: Path | None = None) -> str:
        self.count += 1
        return self.cluster.shared(fresh_copy(tree or self.tree, f"{tag}{self.count}"))

    def prestage(self, on: bool) -> None:
        self.cluster.planner("start" if on else "stop")

    def queued(
        self, tag: str, blockers: dict[str, tuple[int, float]], nodes: int
    ) -> tuple[pj.Run, object]:
        """Blockers (node: (limit min, seconds)), then the user's job declaring a fresh
        dataset on ``nodes`` nodes; its run, and the storage bytes while it was queued
        and ran. Every blocker still running is cancelled after."""
        cluster = self.cluster
        pj.clear_caches(cluster)
        source = self.fresh(tag)
        ids = [pj.blocker(cluster, node, limit, sleep, f"{tag}-b-{node}")
               for node, (limit, sleep) in blockers.items()]  # fmt: skip
        try:
            pj.wait_running(cluster, ids)
            before = cluster.storage()
            name = f"{tag}-job{self.count}"
            job = pj.submit_declared(cluster, self.user, name, source, nodes)
            run = pj.follow(cluster, job, name)
            moved = cluster.storage() - before
        finally:
            pj.cancel(cluster, ids)
        if not run.ok:
            raise SystemExit(f"{name} failed ({run.info.get('JobState')}):\n{run.output}")
        return run, moved

    # ---- the scenarios ------------------------------------------------------------

    def hit(self, rep: int, on: bool) -> dict:
        nodes = self.cluster.nodes
        planned = nodes[1 + rep % (len(nodes) - 1)]  # never the first
        lead = self.args.lead
        blockers = {n: (1, lead) if n == planned else (60, 3600) for n in nodes}
        run, moved = self.queued(f"hit-{'on' if on else 'off'}", blockers, 1)
        return self.row(run, moved, planned)

    def four(self, rep: int, on: bool) -> dict:
        blockers = dict.fromkeys(self.cluster.nodes, (1, self.args.lead4))
        run, moved = self.queued(f"four-{'on' if on else 'off'}", blockers, len(blockers))
        return self.row(run, moved, ",".join(self.cluster.nodes))

    def wrong(self, rep: int, on: bool) -> dict:
        nodes = self.cluster.nodes
        planned = nodes[1 + rep % (len(nodes) - 1)]
        early = nodes[1 + (rep + 1) % (len(nodes) - 1)]
        lead = self.args.lead
        blockers = {}
        for node in nodes:  # planned: ends by its limit first; early: really ends first
            blockers[node] = (1, lead) if node == planned else (60, 3600)
        blockers[early] = (10, self.args.early)
        index = nodes.index(planned) + 1
        before = pj.prefetch_counts(self.cluster, index)
        run, moved = self.queued(f"wrong-{'on' if on else 'off'}", blockers, 1)
        wasted = 0.0
        deadline = time.monotonic() + 3 * self.args.plan_interval + 10
        while on and time.monotonic() < deadline:  # the planner's cancel, then the drop
            after = pj.prefetch_counts(self.cluster, index)
            wasted = after.get("bytes_wasted", 0) - before.get("bytes_wasted", 0)
            if wasted:
                break
            time.sleep(1)
        row = self.row(run, moved, planned)
        row["wasted"] = wasted
        if run.ran_on != early:
            row["note"] = f"ran on {run.ran_on}, not {early}"
        return row

    def placement(self, tries: int) -> list[dict]:
        cluster, nodes = self.cluster, self.cluster.nodes
        rows = []
        for attempt in range(tries):
            pj.clear_caches(cluster)
            holder = nodes[1 + attempt % (len(nodes) - 1)]  # never the first
            source = self.fresh("place", self.small)
            name = f"place{self.count}"
            words = pj.declaration(name, source).removeprefix("#STAGER ").strip()
            tag = feature(words)
            hold = pj.submit_declared(
                cluster, self.user, f"{name}-hold", source, extra=[f"--nodelist={holder}"],
                dataset=name,
            )  # fmt: skip
            held = pj.follow(cluster, hold, f"{name}-hold")
            if not held.ok:
                raise SystemExit(f"staging on {holder} failed:\n{held.output}")
            deadline = time.monotonic() + 30
            while tag not in cluster.node_info(holder).get("ActiveFeatures", ""):
                if time.monotonic() > deadline:
                    raise SystemExit(f"{holder} never got {tag}: {cluster.node_info(holder)}")
                time.sleep(0.5)
            job = pj.submit_declared(cluster, self.user, name, source)
            run = pj.follow(cluster, job, name)
            rows.append({"holder": holder, "ran_on": run.ran_on, "hit": run.all_hit,
                         "seconds": run.seconds, "client": run.client_s,
                         "ok": run.ok})  # fmt: skip
        return rows

    def row(self, run: pj.Run, moved: object, planned: str) -> dict:
        return {
            "seconds": run.seconds,
            "client": run.client_s,
            "hit": run.all_hit,
            "hows": run.hows,
            "planned": run.planned,
            "meant": planned,
            "ran_on": run.ran_on,
            "storage": moved.content / self.size,  # type: ignore[attr-defined]
            "held": pj.held_or_requeued(run),
        }


def paired(bench: Bench, scenario: str, runs: int) -> dict[str, list[dict]]:
    """``runs`` pairs, on and off alternating which goes first."""
    done: dict[str, list[dict]] = {"on": [], "off": []}
    for rep in range(runs):
        for on in (True, False) if rep % 2 == 0 else (False, True):
            bench.prestage(on)
            row = getattr(bench, scenario)(rep, on)
            done["on" if on else "off"].append(row)
            print(f"  {scenario} {'on ' if on else 'off'} run {rep + 1}: {brief(row)}", flush=True)
    bench.prestage(True)
    return done


def brief(row: dict) -> str:
    extra = f", wasted {row['wasted'] / 1e6:.0f} MB" if "wasted" in row else ""
    held = f", HELD {row['held']}" if row["held"] else ""
    note = f", {row['note']}" if "note" in row else ""
    return (
        f"{row['seconds']:.2f} s start->ready (client alone {row['client']:.2f} s), "
        f"{'/'.join(row['hows'])}, planned "
        f"{row['planned'] or '-'}, ran on {row['ran_on']}, storage {row['storage']:.2f}x"
        f"{extra}{held}{note}"
    )


def median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def table(results: dict, placement: list[dict], args: argparse.Namespace, size: int) -> str:
    lines = [
        "| scenario | pre-staging | start -> data ready (median) | hit | storage read | wasted |",
        "|---|---|---|---|---|---|",
    ]
    labels = {"hit": "1-node job, queued", "four": "4-node job, queued",
              "wrong": "1-node job, plan wrong"}  # fmt: skip
    for scenario, by in results.items():
        for mode in ("on", "off"):
            rows = by[mode]
            hits = sum(r["hit"] for r in rows)
            wasted = f"{median(rows, 'wasted') / 1e6:.0f} MB" if "wasted" in rows[0] else ""
            lines.append(
                f"| {labels[scenario]} | {mode} | {median(rows, 'seconds'):.2f} s | "
                f"{hits} of {len(rows)} | {median(rows, 'storage'):.2f}x | {wasted} |"
            )
        on, off = median(by["on"], "seconds"), median(by["off"], "seconds")
        lines.append(f"| {labels[scenario]} | on / off | {on / off:.2f}x | | | |")
    if placement:
        right = sum(r["ran_on"] == r["holder"] for r in placement)
        hits = sum(r["hit"] for r in placement)
        seconds = statistics.median(r["seconds"] for r in placement)
        lines.append(
            f"| placement ({args.placement_mb} MB held by mn2-4) | on | {seconds:.2f} s | "
            f"{hits} of {len(placement)} | started on the holder {right} of {len(placement)} | |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=200, help="dataset size (default 200)")
    parser.add_argument("--rate", default="200mbit", help="storage link (default 200mbit)")
    parser.add_argument("--runs", type=int, default=3, help="pairs per scenario (default 3)")
    parser.add_argument("--tries", type=int, default=10, help="placement tries (default 10)")
    parser.add_argument("--placement-mb", type=int, default=20, help="placement's dataset")
    parser.add_argument("--lead", type=float, default=50, help="s the 1-node job is queued")
    parser.add_argument("--lead4", type=float, default=75, help="s the 4-node job is queued")
    parser.add_argument("--early", type=float, default=35,
                        help="wrong: s until the other node's blocker ends")  # fmt: skip
    parser.add_argument("--plan-interval", type=int, default=5)
    parser.add_argument("--scenarios", nargs="+", default=["hit", "four", "wrong", "placement"])
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("bench_prestage needs root: namespaces, mounts, slurmd, users")
        return 2
    print(f"load average at start: {os.getloadavg()}", flush=True)
    started = time.monotonic()
    cluster = Cluster(nodes=4, rate=args.rate, local_size="2g", prestage=True,
                      plan_interval=args.plan_interval)  # fmt: skip
    with made_users() as (alice, _), usable_by_everyone():
        cluster.up()
        try:
            cluster.jobs_dir.chmod(0o1777)
            bench = Bench(cluster, (alice.uid, alice.gid), args)
            print(f"dataset {bench.size / 1e6:.0f} MB, storage {args.rate}", flush=True)
            results = {}
            for scenario in ("hit", "four", "wrong"):
                if scenario in args.scenarios:
                    results[scenario] = paired(bench, scenario, args.runs)
            placement = bench.placement(args.tries) if "placement" in args.scenarios else []
            for row in placement:
                print(f"  placement: {row}")
            size = bench.size
        finally:
            namespaces = cluster.namespaces
            cluster.down()
    left = leftovers(namespaces)
    print(f"\n{table(results, placement, args, size)}\n")
    print(f"took {time.monotonic() - started:.0f} s; load average at end: {os.getloadavg()}")
    if left:
        print(f"down.sh left: {left}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
