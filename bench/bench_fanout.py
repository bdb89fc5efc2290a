"""Multi-node staging with fan-out on the 4-node test cluster (deploy/slurm/multinode):
bytes that leave the shared storage, and wall time to ready on every node, for
N = 1, 2, 4 nodes, with the storage link limited to --rate.

Two datasets of --mb MB (random bytes, as incompressible as JPEGs), both staged with
the ``imagefolder`` recipe: a tree of many files (~100 KB each) and a .tar.gz of the
same tree. Each run is a real ``sbatch -N<n>`` job that runs one
``stager-client stage --peers slurm`` and reports its own wall time to ready on
all nodes; every run starts from empty caches. Bytes are counted on the storage
side (its sftp-server's log; its link's counter for the wire total).

``image``: the tree staged as an image dataset (``--as-image``): the source node builds
one EROFS image of it and sends that one file with one sbcast (docs/multinode.md).

Two more shapes read the .tar.gz over HTTP from the storage (a ``http.server`` in the
storage's own network namespace, behind the same rate-limited link; its bytes counted
on that link, the wire column): ``url-file``, one large file fetched as it is
(``fetch``), and ``url-extract``, the archive extracted while it downloads (an
``extract`` of its URL: fetch then extract, overlapped).

Two references in the same run: ``per-node`` (every node of an N=4 job runs its own
``stager-client stage``, which is what a job did before fan-out: the storage is
read N times), and ``held`` (one node other than the batch node already holds the
dataset: nothing should leave the storage).

    sudo .venv/bin/python bench/bench_fanout.py                 # 200 MB, 200 Mbit/s, N=1,2,4
    sudo .venv/bin/python bench/bench_fanout.py --mb 20 --runs 1 --nodes 1 4   # quick look
    ... --compare-modes   # the .tar.gz at N=4, sources broadcast vs prepared tree; an
                          # image dataset at N=4, its image file vs its tree in parts
    ... --nodes 1 --kinds tree --no-references   # only the 1-node tree staging
    ... --kinds url-file url-extract --no-references   # the two HTTP shapes
    ... --kinds image --nodes 1 4 --no-references   # an image dataset, N=1 against N=4
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.multinode import Cluster, fresh_copy, leftovers  # noqa: E402

FILE_BYTES = 100_000
KINDS = ("tree", "tar.gz", "url-file", "url-extract", "image")
HTTP_PORT = 8080  # inside the storage's own network namespace: no clash possible


def make_data(root: Path, total: int) -> tuple[Path, Path]:
    tree = root / "imgs"
    count = max(1, total // FILE_BYTES)
    for i in range(count):
        path = tree / f"class_{i % 10:02d}" / f"img_{i:06d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(FILE_BYTES))
    archive = root / "imgs.tar.gz"
    with tarfile.open(archive, "w:gz", compresslevel=1) as tar:
        tar.add(tree, arcname=".")
    return tree, archive


def serve_http(cluster: Cluster) -> tuple[subprocess.Popen, str]:
    """The storage folder over HTTP, from the storage's namespace; (server, base URL)."""
    address = f"{cluster.values['MN_SUBNET']}.2"
    server = subprocess.Popen(
        ["ip", "netns", "exec", cluster.values["MN_STORAGE_NS"], sys.executable, "-m",
         "http.server", str(HTTP_PORT), "--bind", address, "--directory",
         str(cluster.storage_dir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    return server, f"http://{address}:{HTTP_PORT}"


def what(kind: str, source: str) -> str:
    """The stage flags of ``kind`` reading ``source`` (a path on the nodes, or a URL)."""
    if kind == "url-file":
        step = {"op": "fetch", "url": source, "dst": Path(source).name}
    elif kind == "url-extract":
        step = {"op": "extract", "src": source}
    elif kind == "image":  # the tree as an image dataset: sent as one file
        return f"--recipe imagefolder --source {source} --as-image"
    else:
        return f"--recipe imagefolder --source {source}"
    return f"--step {shlex.quote(json.dumps(step))}"


def stage_job(
    cluster: Cluster, name: str, kind: str, source: str, nodes: int, broadcast: str
) -> dict:
    script = f"""
stager-client stage {name} {what(kind, source)} --peers slurm \\
    --broadcast {broadcast} --timeout 900 --json > {cluster.jobs_dir}/{name}.json
"""
    job = cluster.sbatch(script, nodes=nodes, name=name, timeout=1200)
    report_path = cluster.jobs_dir / f"{name}.json"
    if not job.ok or not report_path.exists():
        raise SystemExit(f"job {job.job_id} ({name}) {job.state} {job.exit_code}:\n{job.output}")
    return json.loads(report_path.read_text())


def per_node_job(cluster: Cluster, name: str, kind: str, source: str, nodes: int) -> dict:
    """Every node stages for itself (no --peers): the reference fan-out replaces."""
    times = cluster.jobs_dir / f"{name}.times"
    script = f"""
date +%s.%N > {times}
srun --nodes={nodes} --ntasks-per-node=1 stager-client stage {name} {what(kind, source)} \\
    --wait --timeout 900 >/dev/null
date +%s.%N >> {times}
"""
    job = cluster.sbatch(script, nodes=nodes, name=name, timeout=1200)
    if not job.ok:
        raise SystemExit(f"job {job.job_id} ({name}) {job.state} {job.exit_code}:\n{job.output}")
    start, end = (float(x) for x in times.read_text().split())
    return {"seconds": end - start, "mode": "per-node", "nodes": {}, "timeline": {}}


def hold_on_one_node(cluster: Cluster, name: str, kind: str, source: str) -> None:
    """Stage ``source`` on the third node alone (not the batch node of the next job)."""
    holder = cluster.nodes[min(2, len(cluster.nodes) - 1)]
    script = f"stager-client stage {name} {what(kind, source)} --wait\n"
    job = cluster.sbatch(script, nodes=1, name=name, timeout=1200, extra=[f"--nodelist={holder}"])
    if not job.ok:
        raise SystemExit(f"staging on {holder} alone failed:\n{job.output}")


def clear_caches(cluster: Cluster) -> None:
    job = cluster.sbatch(
        f"srun --nodes={len(cluster.nodes)} --ntasks-per-node=1 stager gc --all >/dev/null\n",
        nodes=len(cluster.nodes),
        name="gc",
    )
    if not job.ok:
        raise SystemExit(f"clearing the caches failed:\n{job.output}")


def measure(
    cluster: Cluster, kind: str, source: Path, nodes: int, broadcast: str, run: int, http: str
):
    source = fresh_copy(source, f"{kind}-r{run}-n{nodes}-{broadcast}")
    clear_caches(cluster)
    name = f"{kind.replace('.', '')}-n{nodes}-{broadcast}-r{run}"
    if kind.startswith("url-"):
        shared = f"{http}/{source.relative_to(cluster.storage_dir)}"
    else:
        shared = cluster.shared(source)
    if broadcast == "held":
        hold_on_one_node(cluster, f"{name}-hold", kind, shared)
    before = cluster.storage()
    if broadcast == "per-node":
        report = per_node_job(cluster, name, kind, shared, nodes)
    else:
        mode = "auto" if broadcast == "held" else broadcast
        report = stage_job(cluster, name, kind, shared, nodes, mode)
    moved = cluster.storage() - before
    failed = [n for n, r in report["nodes"].items() if r["error"]]
    if failed:
        raise SystemExit(f"nodes {failed} failed: {json.dumps(report, indent=1)}")
    return report, moved


def source_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=200)
    parser.add_argument("--rate", default="200mbit")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--compare-modes", action="store_true")
    parser.add_argument("--no-references", action="store_true", help="skip per-node and held")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    args = parser.parse_args()

    local = f"{max(1, args.mb * 5 // 1000 + 1)}g"  # room for data, delivery and bundle
    cluster = Cluster(nodes=max(args.nodes), rate=args.rate, local_size=local)
    print(f"load before: {os.getloadavg()[0]:.2f}; storage link {args.rate}", flush=True)
    cluster.up()
    server, http = serve_http(cluster)
    try:
        tree, archive = make_data(cluster.storage_dir, args.mb * 1_000_000)
        sizes = {"tree": source_bytes(tree), "tar.gz": source_bytes(archive)}
        sizes["url-file"] = sizes["url-extract"] = sizes["tar.gz"]
        sizes["image"] = sizes["tree"]
        print(f"tree: {sizes['tree'] / 1e6:.0f} MB in {len(list(tree.rglob('*.jpg')))} files; "
              f"tar.gz: {sizes['tar.gz'] / 1e6:.0f} MB", flush=True)  # fmt: skip
        results: dict[tuple[str, int, str], list] = {}
        plan = [(kind, n, "auto") for kind in args.kinds for n in args.nodes]
        if not args.no_references:
            most = max(args.nodes)
            plan += [(kind, most, how) for kind in args.kinds for how in ("per-node", "held")]
        if args.compare_modes and "tar.gz" in args.kinds:
            plan += [
                ("tar.gz", max(args.nodes), "prepared"),
                ("tar.gz", max(args.nodes), "sources"),
            ]
        if args.compare_modes and "image" in args.kinds:  # the image file against its tree
            plan += [("image", max(args.nodes), "prepared")]
        for run in range(args.runs):
            for kind, nodes, broadcast in plan:
                source = tree if kind in ("tree", "image") else archive
                report, moved = measure(cluster, kind, source, nodes, broadcast, run, http)
                results.setdefault((kind, nodes, broadcast), []).append((report, moved))
                read = moved.wire if kind.startswith("url-") else moved.content
                print(f"  run {run}: {kind} N={nodes} {broadcast}: {report['seconds']:.1f} s, "
                      f"mode {report['mode']}, storage {read / sizes[kind]:.3f}x, "
                      f"sent {report.get('sent_bytes', 0) / 1e6:.0f} MB "
                      f"({report.get('early_bytes', 0) / 1e6:.0f} MB while staging), "
                      f"timeline {report['timeline']}", flush=True)  # fmt: skip
        print(f"\nload after: {os.getloadavg()[0]:.2f}")
        print_table(results, sizes, args)
    finally:
        server.terminate()
        server.wait(timeout=10)
        namespaces = cluster.namespaces
        cluster.down()
        left = leftovers(namespaces)
        if left:
            print(f"LEFT BEHIND: {left}")
    return 0


def print_table(results: dict, sizes: dict[str, int], args: argparse.Namespace) -> None:
    print(f"\n{args.mb} MB, storage link {args.rate}, median of {args.runs} run(s)")
    print("| dataset | N | mode | wall time to ready on all nodes | vs N=1 | "
          "storage bytes / source (content; HTTP: none) | (wire; HTTP: all of it) |")  # fmt: skip
    print("|---|---:|---|---:|---:|---:|---:|")
    for (kind, nodes, broadcast), runs in sorted(results.items()):
        seconds = statistics.median(r["seconds"] for r, _ in runs)
        base = results.get((kind, 1, "auto"))
        ratio = seconds / statistics.median(r["seconds"] for r, _ in base) if base else None
        content = statistics.median(m.content for _, m in runs) / sizes[kind]
        wire = statistics.median(m.wire for _, m in runs) / sizes[kind]
        mode = runs[0][0]["mode"]
        if broadcast == "held":
            mode += " (one node holds it)"
        elif broadcast not in ("auto", "per-node"):
            mode += " (forced)"
        spread = (
            f" ({min(r['seconds'] for r, _ in runs):.1f}-{max(r['seconds'] for r, _ in runs):.1f})"
        )
        shown = f"{ratio:.2f}x" if ratio is not None else "-"
        print(f"| {kind} | {nodes} | {mode} | {seconds:.1f} s{spread} | {shown} | "
              f"{content:.3f}x | {wire:.3f}x |")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
