"""The planner against a real slurmctld doing backfill: job_submit.lua copies a
job's #STAGER lines into its AdminComment, squeue shows them with the planned start
and nodes, and `stager plan --dry-run` names the job, its user, its node and its
datasets, and why it skips root's job and a job that declares nothing."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from stager.prestage.plan import squeue
from stager.prestage.plan.declared import lines
from tests.deploy.test_placement_slurm import stop_prolog_daemon
from tests.slurm_cluster import Cluster
from tests.trees import digest, write_tree
from tests.users import User

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

BACKFILL_WAIT_S = 120  # bf_interval is 5 s on the local cluster: a bound for a loaded machine
HOLD_FLAGS = ["--parsable", "--exclusive", "--time=5", "--chdir=/tmp", "--output=/dev/null"]
DECLARED = [
    "inat --recipe inat2021 --source /net/inat",
    'odd --step \'{"op": "copy", "src": "/d/a|b;c%d"}\' --as-image',
]


@pytest.fixture
def jobs(local_cluster: Cluster) -> Iterator[list[str]]:
    """The ids of the jobs a test submits, all cancelled at its end."""
    submitted: list[str] = []
    try:
        yield submitted
    finally:
        if submitted:
            subprocess.run(["scancel", *submitted], capture_output=True, timeout=60)


def submit(user: User | None, script: str, jobs: list[str], *flags: str) -> str:
    argv = ["sbatch", *HOLD_FLAGS, *flags]
    if user is None:
        done = subprocess.run(argv, input=script, capture_output=True, text=True, timeout=60)
    else:
        done = user.run(argv, input=script)
    assert done.returncode == 0, f"sbatch refused the job: {done.stderr}"
    job_id = done.stdout.strip().split(";")[0]
    jobs.append(job_id)
    return job_id


def script(*declared: str) -> str:
    return "#!/bin/bash\n" + "".join(f"#STAGER {d}\n" for d in declared) + "sleep 1\n"


def queue() -> dict[str, squeue.QueuedJob]:
    text = squeue.Squeue().read()
    found, problems = squeue.parse(text)
    assert not problems, problems
    return {job.job_id: job for job in found}


def dry_run() -> str:
    done = subprocess.run(
        [sys.executable, "-m", "stager", "plan", "--dry-run"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_dry_run_names_a_queued_jobs_planned_node_user_and_data(
    jobs: list[str], users: tuple[User, User]
) -> None:
    alice, bob = users
    host = socket.gethostname().split(".")[0]
    submit(None, "#!/bin/bash\nsleep 300\n", jobs)  # holds the node: the rest wait
    wanted = submit(alice, script(*DECLARED), jobs)
    nothing = submit(bob, script(), jobs)
    rooted = submit(None, script(DECLARED[0]), jobs)
    # job_submit.lua, for real: the lines as written, one squeue line each.
    assert lines(queue()[wanted].admin_comment or "") == DECLARED
    assert queue()[nothing].admin_comment is None
    deadline = time.monotonic() + BACKFILL_WAIT_S
    while not queue()[wanted].sched_nodes and time.monotonic() < deadline:
        time.sleep(2)
    assert queue()[wanted].sched_nodes == (host,), "no backfill plan for the job"
    out = dry_run()
    assert f"plan: job {wanted} of {alice.name} (uid {alice.uid}), gid {alice.gid}" in out
    assert f"on {host}: pre-stage inat, odd" in out
    assert f"would stage on {host} as {alice.name} (uid {alice.uid}): inat (recipe" in out
    assert (
        f"would stage on {host} as {alice.name} (uid {alice.uid}): odd (1 step(s), as an image)"
        in out
    )
    assert f"skip: job {nothing} of {bob.name}" in out and "declares nothing" in out
    assert f"skip: job {rooted} of root" in out and "root's job" in out


def test_job_submit_lua_never_fails_a_submission(jobs: list[str], users: tuple[User, User]) -> None:
    alice, _ = users
    odd = {
        "many": script(*(f"d{i} --recipe r --source /s{i}" for i in range(100))),
        "binary": "#!/bin/bash\n#STAGER b --recipe r --source /\x01\x7f\xff\n" + "x" * 100_000,
        "bare": "#!/bin/bash\n#STAGER\n#STAGER   \n",
        # (sbatch itself refuses \r\n line ends)
        "spaces": "#!/bin/bash\n#STAGER\tc --recipe r --source /s \t\necho\n",
        "late": "#!/bin/bash\necho\n#STAGER late --recipe r --source /s\n",
    }
    ids = {name: submit(alice, text, jobs, "--hold") for name, text in odd.items()}
    # A run of spaces inside a line: the lua's reading must stay linear, since it runs
    # inside slurmctld (a backtracking pattern took 7.4 s for 32k spaces, 2 h for 1 MB).
    for name, line in {
        "long": "#STAGER x" + " " * 60_000 + "y --recipe r --source /s",
        "spaced": "#STAGER e" + " " * 1500 + "--recipe r --source /s" + " " * 2000,
    }.items():
        began = time.monotonic()
        ids[name] = submit(alice, f"#!/bin/bash\n{line}\necho\n", jobs, "--hold")
        assert time.monotonic() - began < 5, f"sbatch took {time.monotonic() - began:.1f} s"
    found = queue()
    assert found[ids["long"]].admin_comment is None  # past the bound: not read
    assert lines(found[ids["spaced"]].admin_comment or "") == [
        "e" + " " * 1500 + "--recipe r --source /s"
    ]
    many = lines(found[ids["many"]].admin_comment or "")
    assert many == [f"d{i} --recipe r --source /s{i}" for i in range(32)]  # bounded
    assert lines(found[ids["spaces"]].admin_comment or "") == ["c --recipe r --source /s"]
    assert found[ids["bare"]].admin_comment is None
    assert found[ids["late"]].admin_comment is None  # after the first command, as #SBATCH
    assert found[ids["binary"]].uid == alice.uid


def test_from_script_in_a_job_reads_the_batch_script_slurm_stored(
    jobs: list[str], tmp_path: Path
) -> None:
    """Without SCRIPT, `stage --from-script` reads the job's script as slurmctld stored it
    at submit (`scontrol write batch_script`), what the planner pre-staged from."""
    source = write_tree(tmp_path / "source", n_files=5, max_size=2000)
    # A name of its own: root's daemon and its cache outlive a test session.
    step = json.dumps({"op": "copy", "src": str(source)})
    name = f"tiny-{uuid.uuid4().hex[:8]}"
    body = (
        f"#!/bin/bash\n#STAGER {name} --step '{step}' --link {tmp_path}/linked\n"
        f"{sys.executable} -m client.cli stage --from-script --wait --timeout 60\n"
    )
    argv = ["sbatch", "--parsable", "--wait", f"--chdir={tmp_path}",
            f"--output={tmp_path}/job-%j.out", "--time=5"]  # fmt: skip
    done = subprocess.run(argv, input=body, capture_output=True, text=True, timeout=180)
    jobs.append(done.stdout.strip().split(";")[0])
    output = next(tmp_path.glob("job-*.out")).read_text()
    assert done.returncode == 0, output
    assert digest(tmp_path / "linked") == digest(source)
    assert Path(output.strip().splitlines()[-1]).resolve() == (tmp_path / "linked").resolve()


def test_an_array_jobs_pending_tasks_are_planned_by_their_raw_job_id(
    jobs: list[str], users: tuple[User, User], interpreter_for_users: str
) -> None:
    """squeue's JobID is the raw job id: an array's pending tasks are one record whose id
    is a plain number (JobArrayID would print 123_[1-3]), planned as any job. Each task
    that starts gets an id of its own; its own request finds the prefetch by its user and
    key, whatever its id."""
    alice, _ = users
    host = socket.gethostname().split(".")[0]
    holder = submit(None, "#!/bin/bash\nsleep 300\n", jobs)
    base = submit(alice, script(DECLARED[0]), jobs, "--array=1-3")
    deadline = time.monotonic() + BACKFILL_WAIT_S
    while not (record := queue()[base]).sched_nodes and time.monotonic() < deadline:
        time.sleep(2)
    assert record.state == "PENDING" and record.sched_nodes == (host,), record
    out = dry_run()
    assert f"plan: job {base} of {alice.name} (uid {alice.uid})" in out, out
    assert f"would stage on {host} as {alice.name} (uid {alice.uid}): inat" in out
    subprocess.run(["scancel", holder], capture_output=True, timeout=60, check=True)
    try:
        deadline = time.monotonic() + 60
        while not (
            started := [j for j in queue().values() if j.uid == alice.uid and j.job_id != base]
        ):
            assert time.monotonic() < deadline, "no task of the array started"
            time.sleep(1)
        assert all(j.job_id.isdigit() for j in started), started
    finally:
        subprocess.run(["scancel", base], capture_output=True, timeout=60)
        # A task's prolog may still be starting alice's daemon: stopped only once every
        # task has left the queue (prologs and epilogs done), it cannot outlive the test.
        gone_by, listed = time.monotonic() + 60, ["squeue", "--noheader", "-j", base]
        while subprocess.run(listed, capture_output=True, text=True, timeout=60).stdout.strip():
            if time.monotonic() > gone_by:
                break  # the stop below still runs; the session's check reports a survivor
            time.sleep(1)
        stop_prolog_daemon(alice, interpreter_for_users)
