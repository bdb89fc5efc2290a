from __future__ import annotations

import pytest

from tests.trainer.conftest import run_srun_trainer, run_trainer, tiny_args, trainer_env
from trainer import checkpoint
from trainer.distributed import DistributedEnvError, World, first_host, slurm_port


def test_single_process_by_default():
    w = World.detect({})
    assert (w.rank, w.world_size, w.launcher, w.distributed) == (0, 1, "single", False)


def test_sbatch_without_srun_is_single_process():
    # The batch script has job-level SLURM variables but no step: one process.
    w = World.detect({"SLURM_JOB_ID": "77", "SLURM_PROCID": "0", "SLURM_NTASKS": "4"})
    assert w.launcher == "single" and w.slurm_job_id == "77"


def test_torchrun():
    env = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "n1",
           "MASTER_PORT": "2950", "LOCAL_WORLD_SIZE": "2"}  # fmt: skip
    w = World.detect(env)
    assert (w.rank, w.local_rank, w.world_size) == (3, 1, 4)
    assert (w.master_addr, w.master_port) == ("n1", 2950)
    assert w.launcher == "torchrun" and w.local_world_size == 2


def test_srun_step():
    env = {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_STEP_NUM_TASKS": "8",
           "SLURM_STEP_NODELIST": "gpu[07-10,12]", "SLURM_JOB_ID": "123456",
           "SLURM_CPUS_PER_TASK": "6", "SLURM_STEP_TASKS_PER_NODE": "2(x4)"}  # fmt: skip
    w = World.detect(env)
    assert (w.rank, w.local_rank, w.world_size) == (5, 1, 8)
    assert w.master_addr == "gpu07" and w.master_port == slurm_port("123456")
    assert w.cpus_per_task == 6 and w.local_world_size == 2 and w.launcher == "srun"
    # Every task computes the same port from the job id.
    assert World.detect(dict(env, SLURM_PROCID="0")).master_port == w.master_port


@pytest.mark.parametrize(
    "env, missing",
    [
        ({"RANK": "0", "WORLD_SIZE": "2"}, "LOCAL_RANK, MASTER_ADDR, MASTER_PORT"),
        ({"SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "0", "SLURM_JOB_ID": "1"}, "SLURM_LOCALID"),
    ],
)
def test_half_set_environment_is_a_clear_error(env, missing):
    with pytest.raises(DistributedEnvError, match=missing):
        World.detect(env)


@pytest.mark.parametrize(
    "nodelist, host",
    [("cn1", "cn1"), ("cn1,cn2", "cn1"), ("gpu[03-05,09]", "gpu03"),
     ("gpu[3,5]-ib,x", "gpu3-ib"), ("a-[001-002],b[1-2]", "a-001")],
)  # fmt: skip
def test_first_host(nodelist, host):
    assert first_host(nodelist) == host


def test_cli_reports_half_set_env(tmp_path):
    done = run_trainer(tiny_args(tmp_path, "--epochs", "1"), env=trainer_env(RANK="0"))
    assert done.returncode == 1
    assert "half set" in done.stderr and "LOCAL_RANK" in done.stderr


@pytest.mark.slow
def test_srun_step_trains_as_one_gloo_group(tmp_path):
    # Two processes with only the step-level variables srun sets (no RANK or
    # WORLD_SIZE, no MASTER_PORT): the port comes from the job id.
    rank0, rank1 = run_srun_trainer(tiny_args(tmp_path, "--iterations", "3"))
    assert rank0.returncode == 0, rank0.stderr[-3000:]
    assert rank1.returncode == 0, rank1.stderr[-3000:]
    assert "on 2 process(es) via srun" in rank0.stderr
    assert "(n=21)" in rank0.stderr  # evaluation over both ranks' shards, each sample once
    assert checkpoint.latest(tmp_path / "checkpoints").name == "checkpoint-000000003.pt"


def test_cli_reports_half_set_srun_env(tmp_path):
    env = trainer_env(SLURM_STEP_NUM_TASKS="2", SLURM_PROCID="0", SLURM_JOB_ID="9")
    done = run_trainer(tiny_args(tmp_path, "--epochs", "1"), env=env)
    assert done.returncode == 1
    assert "srun launch is half set" in done.stderr and "SLURM_LOCALID" in done.stderr
    assert "Traceback" not in done.stderr
