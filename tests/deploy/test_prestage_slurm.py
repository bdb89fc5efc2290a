"""Pre-staging end to end on the one-node local cluster (deploy/slurm/local-cluster: a
real slurmctld doing backfill, job_submit.lua), the CI-sized part of
tests/deploy/test_prestage_multinode.py: a real user's job declaring data, queued
behind root's blocker, is planned on the node by backfill; the planner (`stager plan`,
as root) orders a node service's prefetch port to stage it as the user; the planner is
then killed. The job still starts within a second of its blocker's end, is never held
nor requeued, and its own `stage --from-script` at its start is a hit.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path

import pytest

from tests.daemon import Daemon, free_privileged_port, node_service
from tests.deploy.test_placement_slurm import stop_prolog_daemon
from tests.slurm_cluster import Cluster, job_info
from tests.trees import write_tree
from tests.users import User

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

HOST = socket.gethostname().split(".")[0]
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


def until(check: Callable[[], bool], what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {what}"
        time.sleep(0.3)


def backfill_interval() -> int:
    """slurm.conf's bf_interval (30 by default): how soon a pending job gets its plan."""
    config = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True).stdout
    found = re.search(r"bf_interval=(\d+)", config)
    return int(found.group(1)) if found else 30


@pytest.fixture
def service(local_cluster: Cluster, shared_tmp: Path) -> Iterator[tuple[Daemon, int]]:
    """The node service with its prefetch port on the loopback; and the port."""
    port = free_privileged_port()
    with node_service(
        shared_tmp / "cache", STAGER_PREFETCH_LISTEN=f"127.0.0.1:{port}", STAGER_NODE_NAME=HOST
    ) as daemon:
        yield daemon, port


@pytest.fixture
def jobs(local_cluster: Cluster) -> Iterator[list[str]]:
    submitted: list[str] = []
    try:
        yield submitted
    finally:
        if submitted:
            subprocess.run(["scancel", *submitted], capture_output=True, timeout=60)


def started_prefetches(daemon: Daemon) -> float:
    with daemon.client() as client:
        text = client.get("/metrics").text
    found = re.search(r'^stager_prefetches_total\{outcome="started"\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def test_a_queued_job_hits_its_prefetch_and_starts_on_time_with_the_planner_killed(
    service: tuple[Daemon, int],
    users: tuple[User, User],
    shared_tmp: Path,
    interpreter_for_users: str,
    jobs: list[str],
) -> None:
    daemon, port = service
    alice, _ = users
    data = write_tree(shared_tmp / "storage" / "pre", n_files=3, max_size=500)
    for path in [shared_tmp / "storage", *(shared_tmp / "storage").rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    words = f"pre --step '{json.dumps({'op': 'copy', 'src': str(data)})}'"
    out = shared_tmp / "out"
    out.mkdir()
    shutil.chown(out, alice.uid, alice.gid)
    # The blocker: planned (by its limit) to end within a minute, really ending once
    # backfill and the planner have had their turns.
    lead = backfill_interval() + 20
    blocker = subprocess.run(
        ["sbatch", "--parsable", "--exclusive", "--time=1", "--chdir=/tmp", "--output=/dev/null",
         f"--wrap=sleep {lead}"],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout.strip().split(";")[0]  # fmt: skip
    jobs.append(blocker)
    until(lambda: job_info(blocker).get("JobState") == "RUNNING", "the blocker running", 60)
    script = (
        f"#!/bin/bash\n#STAGER {words}\n"
        # The node service under test, not the daemon the task prolog points the job at.
        f"STAGER_URL=unix://{daemon.socket} {interpreter_for_users} -m client stage "
        "--from-script --json\n"
    )
    argv = ["sbatch", "--parsable", "--exclusive", "--time=5", "--chdir=/",
            f"--output={out}/job-%j.out"]  # fmt: skip
    done = alice.run(argv, input=script)
    assert done.returncode == 0, done.stderr
    job = done.stdout.strip().split(";")[0]
    jobs.append(job)
    env = {k: v for k, v in os.environ.items() if not k.startswith("STAGER_")}
    env.update(STAGER_PLAN_INTERVAL="1", STAGER_PLAN_NODE_ADDRESSES=f"{HOST}=127.0.0.1:{port}")
    log = shared_tmp / "planner.log"
    with log.open("w") as written:
        planner = subprocess.Popen(
            [sys.executable, "-m", "stager", "plan"], env=env, stdout=written, stderr=written
        )
    held: list[str] = []

    def prefetched() -> bool:
        info = job_info(job)
        if info.get("Priority") == "0" or "held" in info.get("Reason", "").lower():
            held.append(info.get("Reason", ""))
        return started_prefetches(daemon) > 0

    try:
        until(prefetched, f"a prefetch ordered (planner: {log.read_text()[-600:]})", lead)
    finally:
        planner.kill()  # not stopped: killed, mid-interval or not
        planner.wait(timeout=30)
    try:
        until(lambda: job_info(job).get("JobState") in ENDED, f"job {job} ended", 120)
    finally:
        stop_prolog_daemon(alice, interpreter_for_users)
    info, ended = job_info(job), job_info(blocker)["EndTime"]
    output = next(out.glob("job-*.out")).read_text()
    assert info["JobState"] == "COMPLETED", output
    late = datetime.fromisoformat(info["StartTime"]) - datetime.fromisoformat(ended)
    assert late.total_seconds() <= 1, (info["StartTime"], ended)
    assert not held and info.get("Restarts") == "0", (held, info)
    (status,) = json.loads(output)["data"]
    assert status["state"] == "ready" and status["origin"]["hit"] is True, status
