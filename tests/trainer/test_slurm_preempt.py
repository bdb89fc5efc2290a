"""deploy/slurm/job.sh preempted on the real local SLURM cluster, requeued, resumed.

The job stages a fake iNaturalist release and trains on 2 srun tasks (gloo, CPU)
with a loader worker each. While it trains it gets the time-limit warning that
job.sh asks for (``--signal=B:USR1@120``), sent by ``scancel --signal=USR1 --batch``
(the same delivery, now): the batch script passes it to the step, the ranks save
one checkpoint and exit 75, the job requeues itself, runs again (its prolog too), resumes
from the checkpoint and finishes. Its final weights must equal those of an uninterrupted
run with the same settings.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from bench.fakedata import make_inat2021
from tests.slurm_cluster import BIN_DIR, REPO, Cluster, job_info
from tests.trainer.conftest import finish, start_srun_trainer
from trainer import checkpoint

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

JOB = REPO / "deploy" / "slurm" / "job.sh"
CLASSES, TRAIN_PER_CLASS = 4, 16
EPOCHS, BATCH = 3, 8
TRAIN_ARGS = [
    "--crop-size", "32", "--val-resize-size", "36", "--workers", "1", "--no-tensorboard",
    "--progress", "log", "--print-freq", "1", "--lr", "0.05", "--mixup-alpha", "0.2",
    "--model-ema", "--model-ema-steps", "2", "--keep-checkpoints", "3",
]  # fmt: skip
TIMEOUT_S = 240


@pytest.fixture
def submitted() -> Iterator[list[str]]:
    jobs: list[str] = []
    yield jobs
    if jobs:  # anything still queued or running at the end is cancelled
        subprocess.run(["scancel", *jobs], capture_output=True, check=False)


def _api(cluster: Cluster) -> httpx.Client:
    transport = httpx.HTTPTransport(uds=str(cluster.runtime_dir / "stager.sock"), verify=False)
    return httpx.Client(transport=transport, base_url="http://stager", timeout=10)


def _wait(job: str, done, what: str, output: Path, timeout: float = TIMEOUT_S) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = job_info(job)
        if done(info):
            return info
        time.sleep(0.5)
    info = job_info(job)
    text = output.read_text(errors="replace") if output.exists() else "(no output yet)"
    steps = subprocess.run(["squeue", "--steps", "--jobs", job], capture_output=True, text=True)
    pytest.fail(
        f"job {job}: {what} did not happen within {timeout}s: state {info.get('JobState')}, "
        f"restarts {info.get('Restarts')}, run time {info.get('RunTime')}\n"
        f"steps:\n{steps.stdout}{steps.stderr}\njob output (last 4000 characters):\n{text[-4000:]}"
    )


def _final(out: Path) -> dict:
    return checkpoint.load(checkpoint.latest(out / "checkpoints"))


@pytest.mark.timeout(1200)
def test_usr1_warning_checkpoints_requeues_resumes_and_matches_an_uninterrupted_run(
    local_cluster: Cluster, tmp_path: Path, submitted: list[str]
) -> None:
    source = tmp_path / "inat"
    make_inat2021(source, classes=CLASSES, per_class={"train": TRAIN_PER_CLASS, "val": 4},
                  size=(40, 32))  # fmt: skip
    dataset = f"inat-preempt-{uuid.uuid4().hex[:8]}"
    work = tmp_path / "job"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STAGER_", "SLURM_"))}
    env.update(
        PATH=f"{BIN_DIR}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}",
        INAT_SOURCE=str(source), DATASET=dataset, ARCH="resnet18", EPOCHS=str(EPOCHS),
        BATCH_SIZE=str(BATCH), DEVICE="cpu", OUTPUT_DIR=str(work / "run"),
        TRAIN_ARGS=" ".join([*TRAIN_ARGS, "--record-samples", str(work / "rec")]),
        OMP_NUM_THREADS="1",  # as the reference run below: the same float summation order
    )  # fmt: skip
    submit = subprocess.run(
        ["sbatch", "--parsable", "--gpus-per-task=0", "--cpus-per-task=1", "--mem=3G",
         f"--chdir={work}", f"--output={work}/job-%j.out", str(JOB)],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    job = submit.stdout.strip().split(";")[0]
    submitted.append(job)
    output = work / f"job-{job}.out"

    # Training under way (a few micro-batches done, loader workers running): warn.
    inputs = work / "rec" / "inputs-rank0.txt"
    deadline = time.monotonic() + TIMEOUT_S
    while not (inputs.exists() and len(inputs.read_text().splitlines()) >= 3):
        state = job_info(job).get("JobState")
        assert state in ("PENDING", "CONFIGURING", "RUNNING"), (state, output.read_text())
        assert time.monotonic() < deadline, "training did not start"
        time.sleep(0.2)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True)

    # The same training, uninterrupted, on the same staged files (outside SLURM). It runs
    # while the job is requeued and waits (the node is idle then): the result of either
    # run does not depend on timing (one thread per rank, a fixed summation order).
    with _api(local_cluster) as api:
        staged = api.get(f"/v1/datasets/{dataset}").json()["path"]
    reference = tmp_path / "reference"
    args = ["--dataset", "inat2021", "--data-root", staged, "--arch", "resnet18",
            "--epochs", str(EPOCHS), "--batch-size", str(BATCH), "--device", "cpu",
            "--output-dir", str(reference), *TRAIN_ARGS]  # fmt: skip
    ranks = start_srun_trainer(args)
    try:
        # Requeued, the job waits for its credential to expire (AuthInfo=cred_expire, 10 s
        # on the local cluster) so that its prolog runs again, then runs to the end.
        def finished(info: dict[str, str]) -> bool:
            running = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING")
            return info.get("Restarts") == "1" and info.get("JobState") not in running

        # Both runs share the 2 cores meanwhile: the second may take a few minutes.
        info = _wait(job, finished, "requeue and the second run", output, timeout=2 * TIMEOUT_S)
    finally:
        done = finish(ranks, timeout=2 * TIMEOUT_S)
    assert [r.returncode for r in done] == [0, 0], done[0].stderr[-3000:]
    text = output.read_text(errors="replace")
    assert info.get("JobState") == "COMPLETED" and info.get("Restarts") == "1", (info, text)
    first, _, second = text.partition("(restart 1)")
    assert "got SIGUSR1" in first and "requeueing job" in first, first
    assert "preempted at iteration" in first and "checkpoint saved" in first, first
    assert "resumed from" in second and "(exit 0)" in second, second
    assert "Traceback" not in text and "exited unexpectedly" not in text, text

    # Every training sample once per epoch, across the cut.
    lines = [line.split() for f in (work / "rec").glob("samples-rank*.txt") for line in open(f)]
    seen = Counter((int(e), int(i)) for e, i in lines)
    for epoch in range(EPOCHS):
        assert sorted(i for (e, i), n in seen.items() if e == epoch for _ in range(n)) == list(
            range(CLASSES * TRAIN_PER_CLASS)
        ), epoch

    a, b = _final(reference), _final(work / "run")
    assert a["position"] == b["position"]
    for part in ("model", "model_ema"):
        for key, value in a[part].items():
            assert torch.equal(value, b[part][key]), (part, key)

    with _api(local_cluster) as api:  # leave the node's cache as we found it
        assert api.delete(f"/v1/datasets/{dataset}").status_code in (200, 202, 204)
