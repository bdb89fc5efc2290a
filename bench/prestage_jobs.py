"""Pre-staging scenarios on the multi-node test cluster (deploy/slurm/multinode with
``MN_PRESTAGE=1``): jobs queued behind blockers, so that Slurm's backfill plans where
and when they start, and what a job's own ``stager-client stage --from-script`` finds
when it does. Shared by ``bench/bench_prestage.py``, the never-held tests
(tests/deploy/test_prestage_multinode.py) and ``make demo-prestage``.

A blocker is root's exclusive job on one node: ``--time`` is what backfill plans by,
its ``sleep`` is when it really ends. A job under test is the user's, submitted by the
user (``setpriv``: a job root submits for them is root's submission to
job_submit.lua, which gives it no ``--prefer``), with its ``#STAGER`` line at the top.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.multinode import Cluster, ClusterError

PREFETCH_BYTES = re.compile(r'^stager_prefetch_bytes_total\{outcome="(\w+)"\} (\S+)$', re.M)
PREFETCHES = re.compile(r'^stager_prefetches_total\{outcome="(\w+)"\} (\S+)$', re.M)


@dataclass
class Run:
    """What a job under test saw: where it was planned and where it ran, when it started
    (its batch script's first line) and when its data was ready, and how."""

    job_id: str
    name: str
    planned: str = ""  # SchedNodeList while pending (the last one seen)
    ran_on: str = ""
    start: float = 0.0
    ready: float = 0.0
    client_s: float = 0.0  # a bare `stager-client --version` in the same job, for scale
    hits: list[bool] = field(default_factory=list)  # per node (1 for a 1-node job)
    hows: list[str] = field(default_factory=list)
    info: dict[str, str] = field(default_factory=dict)  # scontrol show job at its end
    ok: bool = False
    output: str = ""
    held: list[str] = field(default_factory=list)  # held or requeued, seen while it ran

    @property
    def seconds(self) -> float:
        """From the job's start to its data ready on every node."""
        return self.ready - self.start

    @property
    def all_hit(self) -> bool:
        return bool(self.hits) and all(self.hits)


def as_user(uid: int, gid: int) -> list[str]:
    """argv prefix: run as this user (uid, gid, their groups)."""
    return ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--init-groups", "--"]


def declaration(name: str, source: str) -> str:
    return f"#STAGER {name} --recipe imagefolder --source {source}\n"


def stage_script(cluster: Cluster, name: str, nodes: int) -> str:
    """The job's body: its start, its declared data staged (fanned out on more nodes
    than one), its end; the client's JSON answer beside."""
    jobs = cluster.jobs_dir
    peers = "--peers slurm" if nodes > 1 else "--wait"
    return f"""t0=$(date +%s.%N)
rc=0
stager-client stage --from-script {peers} --timeout 900 --json > {jobs}/{name}.json || rc=$?
t1=$(date +%s.%N)
stager-client --version >/dev/null  # the client's own start, for scale
t2=$(date +%s.%N)
echo "$t0 $t1 $SLURMD_NODENAME $rc $t2" > {jobs}/{name}.times
exit $rc
"""


def blocker(cluster: Cluster, node: str, limit_min: int, sleep_s: float, name: str) -> str:
    """Root's exclusive job on ``node``: planned to end at ``limit_min``, ends at
    ``sleep_s``."""
    return cluster.submit(
        f"sleep {sleep_s:.0f}\n",
        nodes=1,
        name=name,
        extra=["--exclusive", f"--nodelist={node}", f"--time={limit_min}"],
    )


def wait_running(cluster: Cluster, job_ids: list[str], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    for job_id in job_ids:
        while (state := cluster.job(job_id).get("JobState")) != "RUNNING":
            if time.monotonic() > deadline:
                raise ClusterError(f"blocker {job_id} still {state} after {timeout:.0f} s")
            time.sleep(0.3)


def cancel(cluster: Cluster, job_ids: list[str]) -> None:
    if job_ids:
        subprocess.run(["scancel", *job_ids], env=cluster.env(), check=False)
    for job_id in job_ids:
        deadline = time.monotonic() + 60
        while cluster.job(job_id).get("JobState") in ("RUNNING", "COMPLETING", "PENDING"):
            if time.monotonic() > deadline:
                break
            time.sleep(0.3)


def submit_declared(
    cluster: Cluster, user: tuple[int, int], name: str, source: str, nodes: int = 1,
    extra: list[str] | None = None, dataset: str | None = None,
) -> str:  # fmt: skip
    """The user's exclusive job ``name`` declaring ``source`` as ``dataset`` (default:
    the job's name; two jobs declaring the same line want the same node feature)."""
    return cluster.submit(
        stage_script(cluster, name, nodes),
        nodes=nodes,
        name=name,
        extra=["--exclusive", "--time=10", *(extra or [])],
        header=declaration(dataset or name, source),
        runner=as_user(*user),
    )


def follow(cluster: Cluster, job_id: str, name: str, timeout: float = 900) -> Run:
    """Wait for the job, noting its planned nodes while it is pending; what it saw."""
    run = Run(job_id, name)
    deadline = time.monotonic() + timeout
    while True:
        info = cluster.job(job_id)
        state = info.get("JobState", "?")
        planned = info.get("SchedNodeList", "")
        if state == "PENDING" and planned and planned != "(null)":
            run.planned = planned
        if state == "PENDING" and (
            info.get("Priority") == "0" or "held" in info.get("Reason", "").lower()
        ):
            run.held.append(f"Priority={info.get('Priority')} Reason={info.get('Reason')}")
        if state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "?"):
            break
        if time.monotonic() > deadline:
            cancel(cluster, [job_id])
            raise ClusterError(f"job {job_id} ({name}) still {state} after {timeout:.0f} s")
        time.sleep(0.3)
    run.info = info
    run.ran_on = info.get("NodeList", "")
    run.ok = state == "COMPLETED" and info.get("ExitCode") == "0:0"
    out = cluster.jobs_dir / f"{name}.out"
    run.output = out.read_text() if out.exists() else ""
    times = cluster.jobs_dir / f"{name}.times"
    if times.exists():
        start, ready, *rest = times.read_text().split()
        run.start, run.ready = float(start), float(ready)
        if len(rest) == 3:
            run.client_s = float(rest[2]) - run.ready
    answer = cluster.jobs_dir / f"{name}.json"
    text = answer.read_text() if answer.exists() else ""
    if text.strip():
        report = json.loads(text.splitlines()[-1])
        if "nodes" in report:  # a fan-out's report: one entry per node
            run.hows = [r["how"] for r in report["nodes"].values()]
            run.hits = [how == "hit" for how in run.hows]
        else:  # DatasetsPublic; an error's JSON has none
            for dataset in report.get("data", []):
                origin = dataset.get("origin") or {}
                run.hits.append(bool(origin.get("hit")))
                run.hows.append("hit" if origin.get("hit") else origin.get("how", "?"))
    return run


def prefetch_counts(cluster: Cluster, index: int) -> dict[str, float]:
    """Node ``index``'s prefetch metrics: ``bytes_<outcome>`` and ``count_<outcome>``."""
    text = cluster.node_metrics(index)
    counts = {f"bytes_{k}": float(v) for k, v in PREFETCH_BYTES.findall(text)}
    counts.update({f"count_{k}": float(v) for k, v in PREFETCHES.findall(text)})
    return counts


def clear_caches(cluster: Cluster) -> None:
    """Every node service's cache emptied of what no lease holds (root's gc --all)."""
    sock = Path(cluster.values["MN_ROOT"]) / "private" / "stager-node" / "stager.sock"
    for index in range(1, len(cluster.nodes) + 1):
        cluster.on_node(
            index,
            f"curl -sf --unix-socket {sock} -X POST -H 'content-type: application/json' "
            f"-d '{{\"all\": true}}' http://stager/v1/gc >/dev/null",
        )


def held_or_requeued(run: Run) -> list[str]:
    """Why this job counts as held or requeued (seen while pending, or its restart
    count at its end); empty when it was neither."""
    why = sorted(set(run.held))
    if run.info.get("Restarts", "0") != "0":
        why.append(f"requeued {run.info['Restarts']} time(s)")
    return why
