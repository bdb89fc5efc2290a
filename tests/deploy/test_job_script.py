"""deploy/slurm/job.sh's srun lines, run under a fake ``srun`` that records its flags.

Which flags each step gets is what matters here, and a real slurmd is not needed to
see them (test_slurm_e2e.py runs the script under one).
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

JOB = Path(__file__).resolve().parents[2] / "deploy" / "slurm" / "job.sh"

pytestmark = pytest.mark.skipif(not shutil.which("bash"), reason="job.sh is a bash script")


def fake_bin(folder: Path) -> Path:
    """srun appends its arguments to $SRUN_LOG, one call a line, and runs nothing;
    the stager tools only need to exist for job.sh's PATH check."""
    folder.mkdir()
    scripts = {
        "srun": 'printf "%q " "$@" >>"$SRUN_LOG"; echo >>"$SRUN_LOG"',
        "stager-client": 'printf "%q " stager-client "$@" >>"$SRUN_LOG"; echo >>"$SRUN_LOG"',
        **dict.fromkeys(("stager", "stager-train"), "exit 0"),
    }
    for name, body in scripts.items():
        (folder / name).write_text(f"#!/bin/bash\n{body}\n")
        (folder / name).chmod(0o755)
    return folder


def srun_calls(tmp_path: Path, **slurm: str) -> list[list[str]]:
    log = tmp_path / "srun.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "STAGER_"))}
    env.update(
        PATH=f"{fake_bin(tmp_path / 'bin')}:/usr/bin:/bin",
        SRUN_LOG=str(log),
        SLURM_JOB_ID="7",
        SLURM_TMPDIR=str(tmp_path / "tmp"),
        OUTPUT_DIR=str(tmp_path / "out"),
        **slurm,
    )
    done = subprocess.run(["bash", str(JOB)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return [shlex.split(line) for line in log.read_text().splitlines()]


def test_every_srun_passes_the_jobs_cpus_per_task(tmp_path: Path) -> None:
    # Slurm >= 22.05: srun does not inherit the job's --cpus-per-task by itself.
    calls = [c for c in srun_calls(tmp_path, SLURM_CPUS_PER_TASK="4") if c[0] != "stager-client"]
    assert calls[0][-1] == "--detach"  # no STAGER_URL: daemon, then stage, then train
    assert len(calls) == 3
    for call in calls:
        assert "--cpus-per-task=4" in call, call


def test_without_cpus_per_task_sruns_ask_for_one(tmp_path: Path) -> None:
    calls = [c for c in srun_calls(tmp_path) if c[0] != "stager-client"]
    assert calls and all("--cpus-per-task=1" in call for call in calls), calls


def test_a_multi_node_job_stages_once_in_the_batch_script_with_fanout(tmp_path: Path) -> None:
    calls = srun_calls(tmp_path, SLURM_JOB_NUM_NODES="4", STAGER_URL="unix:///x.sock")
    stages = [c for c in calls if "stage" in c]
    assert len(stages) == 1 and stages[0][0] == "stager-client", calls  # not under srun
    assert "--peers" in stages[0] and stages[0][stages[0].index("--peers") + 1] == "slurm"
    assert f"{tmp_path / 'tmp'}/data/inat2021" in stages[0]  # the link, the same everywhere
    (tmp_path / "off").mkdir()
    off = srun_calls(tmp_path / "off", SLURM_JOB_NUM_NODES="4", STAGER_URL="u", FANOUT="0")
    per_node = [c for c in off if "stage" in c]
    assert per_node[0][0] == "--ntasks=4", off  # srun, one task per node


# ----------------------------------------------------------------- preemption


def preemptible_bin(folder: Path, show_job: str) -> Path:
    """srun runs nothing, except the training step: it waits for a signal and exits 75
    as stager-train does after its checkpoint. scontrol answers ``show job`` with
    ``show_job`` and logs requeues."""
    fake_bin(folder)
    (folder / "srun").write_text(
        "#!/bin/bash\n"
        'printf "%q " "$@" >>"$SRUN_LOG"; echo >>"$SRUN_LOG"\n'
        'if [[ " $* " == *" stager-train "* ]]; then\n'
        "    trap 'exit 75' USR1 TERM\n"
        '    touch "$TRAINING"\n'
        "    while :; do sleep 0.05; done\n"
        "fi\n"
    )
    (folder / "scontrol").write_text(
        "#!/bin/bash\n"
        f'if [[ $1 == show ]]; then echo "JobId=7 {show_job}"; fi\n'
        'if [[ $1 == requeue ]]; then echo "$*" >>"$REQUEUE_LOG"; fi\n'
    )
    (folder / "scontrol").chmod(0o755)
    return folder


def interrupt(tmp_path: Path, sig: int, show_job: str) -> tuple[int, list[str], list[str]]:
    """Run job.sh until training starts, send ``sig`` to the batch script; returns
    (exit code, srun calls' training arguments, requeue calls)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "STAGER_"))}
    env.update(
        PATH=f"{preemptible_bin(tmp_path / 'bin', show_job)}:/usr/bin:/bin",
        SRUN_LOG=str(tmp_path / "srun.log"),
        REQUEUE_LOG=str(tmp_path / "requeue.log"),
        TRAINING=str(tmp_path / "training"),
        SLURM_JOB_ID="7",
        SLURM_TMPDIR=str(tmp_path / "tmp"),
        OUTPUT_DIR=str(tmp_path / "out"),
    )
    job = subprocess.Popen(["bash", str(JOB)], env=env, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not (tmp_path / "training").exists():
        assert job.poll() is None and time.monotonic() < deadline, "training never started"
        time.sleep(0.05)
    job.send_signal(sig)
    job.communicate(timeout=30)
    train = [
        line for line in (tmp_path / "srun.log").read_text().splitlines() if "stager-train" in line
    ]
    requeue_log = tmp_path / "requeue.log"
    requeues = requeue_log.read_text().splitlines() if requeue_log.exists() else []
    return job.returncode, shlex.split(train[0]), requeues


def test_warning_signal_checkpoints_and_requeues(tmp_path: Path) -> None:
    # --signal=B:USR1@120: the batch script gets SIGUSR1 before the time limit.
    code, train, requeues = interrupt(tmp_path, signal.SIGUSR1, "JobState=RUNNING Reason=None")
    assert requeues == ["requeue 7"] and code == 0
    assert "--resume" in train and "--no-requeue" in train  # the script requeues, not rank 0


@pytest.mark.parametrize(
    "show_job, requeued",
    [("JobState=TIMEOUT Reason=TimeLimit", True), ("JobState=COMPLETING Reason=None", False)],
)
def test_sigterm_requeues_at_a_time_limit_not_after_scancel(tmp_path, show_job, requeued):
    code, _, requeues = interrupt(tmp_path, signal.SIGTERM, show_job)
    assert requeues == (["requeue 7"] if requeued else [])
    assert code == (0 if requeued else 75)  # cancelled: the checkpoint stays for a manual resume


@pytest.mark.parametrize(
    ("restarts", "inherited", "run_id"),
    [(None, None, "7.0"), ("2", None, "7.2"), ("2", "from-the-submit-shell", "7.2")],
)
def test_each_requeue_names_its_exit_status_record(tmp_path, restarts, inherited, run_id):
    # The training step's STAGER_TRAIN_RUN_ID names rank 0's OUTPUT/exit-status.json
    # record (docs/trainer.md): one per launch, so a requeued job never reads its
    # previous launch's record as its own.
    bin_dir = fake_bin(tmp_path / "bin")
    (bin_dir / "srun").write_text(
        "#!/bin/bash\n"
        'if [[ " $* " == *" stager-train "* ]]; then\n'
        '    echo "$STAGER_TRAIN_RUN_ID" >"$RUN_ID_LOG"\n'
        "fi\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "STAGER_"))}
    env.update(
        PATH=f"{bin_dir}:/usr/bin:/bin", RUN_ID_LOG=str(tmp_path / "run-id"),
        SLURM_JOB_ID="7", SLURM_TMPDIR=str(tmp_path / "tmp"), OUTPUT_DIR=str(tmp_path / "out"),
        **({"SLURM_RESTART_COUNT": restarts} if restarts else {}),
        **({"STAGER_TRAIN_RUN_ID": inherited} if inherited else {}),
    )  # fmt: skip
    done = subprocess.run(["bash", str(JOB)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "run-id").read_text().split() == [run_id]
