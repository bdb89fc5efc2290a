from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.slurm_cluster import unavailable
from tests.trainer.conftest import finish, run_srun_trainer, start_trainer, tiny_args, trainer_env
from trainer import checkpoint
from trainer.distributed import (
    DistributedEnvError,
    World,
    expand_hostlist,
    first_host,
    slurm_port,
)


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


# Forms from SLURM's documentation (hostlist expressions in sbatch(1), slurm.conf(5)).
HOSTLISTS = {
    "cn1": ["cn1"],
    "cn1,cn2": ["cn1", "cn2"],
    "tux[0-3]": ["tux0", "tux1", "tux2", "tux3"],
    "tux[1,3,5-7]": ["tux1", "tux3", "tux5", "tux6", "tux7"],
    "linux[0-2,128]": ["linux0", "linux1", "linux2", "linux128"],
    "node[08-11]": ["node08", "node09", "node10", "node11"],
    "n[001-003]": ["n001", "n002", "n003"],
    "gpu[03-05,09],cpu1": ["gpu03", "gpu04", "gpu05", "gpu09", "cpu1"],
    "rack[0-1]_blade[0-2]": ["rack0_blade0", "rack0_blade1", "rack0_blade2",
                             "rack1_blade0", "rack1_blade1", "rack1_blade2"],
    "a-[001-002],b[1-2]": ["a-001", "a-002", "b1", "b2"],
    "node[0-1],node[3]": ["node0", "node1", "node3"],
    "x-a[1-2]-b[3-4]": ["x-a1-b3", "x-a1-b4", "x-a2-b3", "x-a2-b4"],
}  # fmt: skip


def _scontrol_works() -> bool:
    if shutil.which("scontrol") is None:
        return False
    try:
        done = subprocess.run(["scontrol", "show", "hostnames", "a[1-2]"],
                              capture_output=True, text=True, timeout=5)  # fmt: skip
    except subprocess.TimeoutExpired:
        return False
    return done.stdout.split() == ["a1", "a2"]


@pytest.mark.parametrize("nodelist", sorted(HOSTLISTS))
def test_hostlist_expansion(nodelist):
    assert expand_hostlist(nodelist) == HOSTLISTS[nodelist]
    assert first_host(nodelist) == HOSTLISTS[nodelist][0]


@pytest.mark.slurm
def test_hostlist_expansion_agrees_with_scontrol(request):
    # SLURM's own expansion is the reference; the local cluster installs it where missing.
    if not _scontrol_works():
        request.getfixturevalue("local_cluster")
    if not _scontrol_works():
        unavailable("scontrol show hostnames does not work here")
    for nodelist, hosts in HOSTLISTS.items():
        done = subprocess.run(["scontrol", "show", "hostnames", nodelist],
                              capture_output=True, text=True, timeout=10)  # fmt: skip
        assert done.stdout.split() == hosts == expand_hostlist(nodelist), nodelist


@pytest.mark.parametrize("nodelist", ["tux[1-", "tux[3-1]", "tux[a-b]", "x]", ""])
def test_bad_hostlists_are_named(nodelist):
    with pytest.raises(DistributedEnvError, match="cannot parse SLURM node list"):
        expand_hostlist(nodelist)


@pytest.mark.slow
def test_srun_step_trains_as_one_gloo_group(tmp_path):
    # Two processes with only the step-level variables srun sets (no RANK or
    # WORLD_SIZE, no MASTER_PORT): the port comes from the job id.
    rank0, rank1 = run_srun_trainer(tiny_args(tmp_path, "--iterations", "3"))
    assert rank0.returncode == 0, rank0.stderr[-3000:]
    assert rank1.returncode == 0, rank1.stderr[-3000:]
    assert "on 2 process(es) via srun" in rank0.stderr
    assert "(n=21)" in rank0.stderr  # evaluation over both ranks' shards, each sample once
    final = checkpoint.load(checkpoint.latest(tmp_path / "checkpoints"))
    assert final["position"]["iteration"] == 3 and final["world_size"] == 2


def test_cli_reports_half_set_torchrun_and_srun_env(tmp_path):
    # Both launchers' variables half set, one run each, side by side.
    srun_env = trainer_env(SLURM_STEP_NUM_TASKS="2", SLURM_PROCID="0", SLURM_JOB_ID="9")
    torchrun, srun = finish(
        [start_trainer(tiny_args(tmp_path / "torchrun", "--epochs", "1"),
                       env=trainer_env(RANK="0")),
         start_trainer(tiny_args(tmp_path / "srun", "--epochs", "1"), env=srun_env)]
    )  # fmt: skip
    assert torchrun.returncode == 1
    assert "half set" in torchrun.stderr and "LOCAL_RANK" in torchrun.stderr
    assert srun.returncode == 1
    assert "srun launch is half set" in srun.stderr and "SLURM_LOCALID" in srun.stderr
    assert "Traceback" not in torchrun.stderr + srun.stderr
