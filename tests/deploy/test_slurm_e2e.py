"""deploy/slurm end to end on a real one-node SLURM cluster.

``deploy/slurm/local-cluster/up.sh`` installs and starts slurmctld, slurmd and munged
with stager's prolog, epilog and task prolog; then ``deploy/slurm/job.sh`` is
``sbatch``-ed twice against a fake iNaturalist 2021 release. The first job must find
no daemon, so its prolog starts one; it stages (a cache miss), links the data under
the job's $SLURM_TMPDIR, trains one epoch in two srun tasks, and its epilog releases
the lease. The second job must be a pure cache hit.

Needs root (packages, slurmd): skipped with the reason otherwise, failed under
CI=true. The session's ``local_cluster`` fixture brings the cluster up and, if it was
not up before, down at the end; the test makes its own state each run (a fresh
daemon, a dataset name of its own) rather than relying on a clean machine.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench.fakedata import make_inat2021
from tests.slurm_cluster import Cluster, expand, job_info

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
JOB = REPO / "deploy" / "slurm" / "job.sh"
BIN_DIR = Path(sys.executable).parent  # the environment running the tests has stager

CLASSES, TRAIN_PER_CLASS, VAL_PER_CLASS = 4, 16, 4
JOB_TIMEOUT_S = 150


@pytest.fixture(scope="module")
def cluster(local_cluster: Cluster) -> Cluster:
    """The session's local cluster (tests/slurm_cluster.py)."""
    return local_cluster


@pytest.fixture
def fake_inat(tmp_path: Path) -> Path:
    source = tmp_path / "inat"
    make_inat2021(
        source,
        classes=CLASSES,
        per_class={"train": TRAIN_PER_CLASS, "val": VAL_PER_CLASS},
        size=(40, 32),
    )
    return source


@pytest.fixture
def submitted() -> Iterator[list[str]]:
    """Job ids this test submitted; any still queued or running at the end is cancelled."""
    jobs: list[str] = []
    yield jobs
    if jobs:
        subprocess.run(["scancel", *jobs], capture_output=True, check=False)


def stop_daemon(cluster: Cluster) -> None:
    """So that the first job's prolog has to start the daemon (and runs current code)."""
    subprocess.run(
        [str(BIN_DIR / "stager"), "stop", "--runtime-dir", str(cluster.runtime_dir)],
        capture_output=True,
        check=True,
    )
    assert not cluster.socket.exists() or not daemon_answers(cluster)


def daemon_answers(cluster: Cluster) -> bool:
    try:
        with cluster.api() as api:
            return api.get("/healthz").status_code == 200
    except httpx.TransportError:
        return False


def log_size(cluster: Cluster) -> int:
    return cluster.log.stat().st_size if cluster.log.exists() else 0


def log_lines(cluster: Cluster, since: int, job_id: str) -> list[str]:
    if not cluster.log.exists():
        return []  # a fresh node: the first prolog has not run yet
    with open(cluster.log, "rb") as handle:
        handle.seek(since)
        text = handle.read().decode(errors="replace")
    return [line for line in text.splitlines() if f" job={job_id} " in line]


def requests_total(cluster: Cluster) -> dict[str, float]:
    with cluster.api() as api:
        text = api.get("/metrics").text
    found = re.findall(r'^stager_requests_total\{outcome="(\w+)"\} ([0-9.e+]+)$', text, re.M)
    return {outcome: float(value) for outcome, value in found}


def run_job(
    cluster: Cluster, since: int, source: Path, dataset: str, workdir: Path, submitted: list[str]
) -> tuple[str, str]:
    """sbatch job.sh, wait for the job and its epilog; returns (job id, job output)."""
    workdir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("STAGER_")}
    env.update(
        PATH=f"{BIN_DIR}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}",
        # A login shell's runtime dir that does not exist on the node: the job must
        # still find its daemon, through the STAGER_URL the task prolog exports.
        XDG_RUNTIME_DIR="/nonexistent/run/user/0",
        INAT_SOURCE=str(source),
        DATASET=dataset,
        ARCH="tinynet",
        EPOCHS="1",
        BATCH_SIZE="8",
        DEVICE="cpu",
        OUTPUT_DIR=str(workdir / "run"),
        TRAIN_ARGS=(
            "--crop-size 32 --val-resize-size 36 --workers 0 --no-tensorboard "
            f"--progress log --record-samples {workdir / 'samples'}"
        ),
    )
    submit = subprocess.run(
        [
            "sbatch",
            "--parsable",
            # This node has no GPUs and two CPUs: one CPU for each of the two tasks.
            "--gpus-per-task=0",
            "--cpus-per-task=1",
            "--mem=3G",
            f"--chdir={workdir}",
            f"--output={workdir}/job-%j.out",
            str(JOB),
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    job_id = submit.stdout.strip().split(";")[0]
    submitted.append(job_id)
    deadline = time.monotonic() + JOB_TIMEOUT_S
    # Done when SLURM has no more work for it (COMPLETING lasts through the epilog)
    # and the epilog has logged its last line.
    while time.monotonic() < deadline:
        state = job_info(job_id).get("JobState", "")
        lines = log_lines(cluster, since, job_id)
        epilog_done = any(" epilog " in line and line.endswith(": finished") for line in lines)
        if state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING") and epilog_done:
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"job {job_id} or its epilog did not finish within {JOB_TIMEOUT_S}s")
    output = (workdir / f"job-{job_id}.out").read_text(errors="replace")
    info = job_info(job_id)
    assert info.get("JobState") == "COMPLETED" and info.get("ExitCode") == "0:0", (
        f"job {job_id} ended {info.get('JobState')} exit {info.get('ExitCode')}:\n{output}"
    )
    return job_id, output


def assert_trained(workdir: Path, output: str) -> None:
    assert "on 2 process(es) via srun" in output, output
    assert re.search(r"epoch 0 \| train loss", output), output
    # Both ranks recorded their share of the epoch; together they cover every image.
    seen: list[int] = []
    for rank in (0, 1):
        lines = (workdir / "samples" / f"samples-rank{rank}.txt").read_text().split()
        seen += [int(index) for index in lines[1::2]]
    assert sorted(set(seen)) == list(range(CLASSES * TRAIN_PER_CLASS))


def assert_linked(cluster: Cluster, job_id: str, dataset: str, output: str) -> Path:
    """The job saw $SLURM_TMPDIR/data/<dataset> pointing into the node's cache."""
    link = Path(expand(cluster.tmpdir_pattern, job_id)) / "data" / dataset
    match = re.search(rf"^\S+: {re.escape(str(link))} -> (\S+)$", output, re.M)
    assert match, f"no link {link} reported in the job output:\n{output}"
    target = Path(match.group(1))
    assert target.parent == cluster.cache_dir / "data", target
    with cluster.api() as api:
        status = api.get(f"/v1/datasets/{dataset}").json()
    assert status["state"] == "ready" and Path(status["path"]) == target, status
    assert (target / "2021_train").is_dir() and (target / "2021_valid").is_dir()
    return target


def assert_epilog(cluster: Cluster, since: int, job_id: str, dataset: str) -> None:
    lines = log_lines(cluster, since, job_id)
    assert any(f"released 1 lease(s) of slurm-job-{job_id}" in line for line in lines), lines
    tmpdir = expand(cluster.tmpdir_pattern, job_id)
    assert any(f"removed SLURM_TMPDIR {tmpdir}" in line for line in lines), lines
    assert not Path(tmpdir).exists()
    with cluster.api() as api:
        leases = api.get(f"/v1/datasets/{dataset}/leases").json()
    assert [lease for lease in leases if lease["holder"] == f"slurm-job-{job_id}"] == []


def assert_lease_of_an_ended_job_is_dropped(cluster: Cluster, job_id: str, dataset: str) -> None:
    """A lease whose job ended without an epilog (node crash, killed slurmd) is dropped
    by the daemon's sweep once real ``scontrol`` says the job is over."""
    with cluster.api() as api:
        stale = {"holder": "stale-holder", "slurm_job_id": job_id}
        assert api.post(f"/v1/datasets/{dataset}/leases", json=stale).status_code == 201
        result = api.post("/v1/gc", json={}).json()
        assert result["leases_dropped"] == 1, result
        assert api.get(f"/v1/datasets/{dataset}/leases").json() == []


@pytest.mark.timeout(600)  # a fresh machine installs slurm-wlm first (minutes)
def test_job_sh_stages_trains_and_hits_the_cache(
    cluster: Cluster, fake_inat: Path, tmp_path: Path, submitted: list[str]
) -> None:
    dataset = f"inat-e2e-{uuid.uuid4().hex[:8]}"  # a name of its own: no 409 from old runs
    stop_daemon(cluster)

    since = log_size(cluster)
    first, output = run_job(cluster, since, fake_inat, dataset, tmp_path / "job1", submitted)
    prolog = [line for line in log_lines(cluster, since, first) if " prolog " in line]
    assert any("started daemon" in line for line in prolog), prolog
    target = assert_linked(cluster, first, dataset, output)
    assert_trained(tmp_path / "job1", output)
    assert_epilog(cluster, since, first, dataset)
    after_first = requests_total(cluster)
    assert after_first.get("miss") == 1.0, after_first
    assert_lease_of_an_ended_job_is_dropped(cluster, first, dataset)

    since = log_size(cluster)
    second, output = run_job(cluster, since, fake_inat, dataset, tmp_path / "job2", submitted)
    prolog = [line for line in log_lines(cluster, since, second) if " prolog " in line]
    assert any("daemon already running" in line for line in prolog), prolog
    assert assert_linked(cluster, second, dataset, output) == target
    assert_trained(tmp_path / "job2", output)
    assert_epilog(cluster, since, second, dataset)
    after_second = requests_total(cluster)
    assert after_second.get("miss") == after_first.get("miss"), (after_first, after_second)
    assert after_second.get("hit", 0.0) == after_first.get("hit", 0.0) + 1, after_second

    # Leave the node's cache as we found it; the daemon keeps running for the next job.
    with cluster.api() as api:
        assert api.delete(f"/v1/datasets/{dataset}").status_code in (200, 202, 204)
