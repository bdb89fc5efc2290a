"""--stager-wait: the trainer waits on the client before it builds the dataset.

The client library is written concurrently; these tests use a stand-in
``client`` package that follows its contract (``StagerClient().wait(name,
timeout)`` -> model with .state/.path; ``client.errors.StagingFailed`` /
``WaitTimeout`` under ``StagerError``). The daemon-staged variant comes with the
integration work; `test_real_client_api` checks the real package when present.
"""

from __future__ import annotations

import datetime
import json
import time
from pathlib import Path

import pytest

from tests.trainer.conftest import (
    REPO,
    free_port,
    make_imagefolder,
    run_trainer,
    tiny_args,
    trainer_env,
)

STUB_INIT = """
import json, os
from types import SimpleNamespace
from client.errors import StagingFailed

class StagerClient:
    def wait(self, name, timeout=None, **callbacks):
        spec = json.loads(os.environ["STUB_STAGER"])
        with open(spec["log"], "a") as f:
            f.write(f"{name} {os.environ.get('RANK', '0')}\\n")
        if spec.get("fail"):
            raise StagingFailed(spec["fail"])
        return SimpleNamespace(state="ready", path=spec["path"])
"""
STUB_ERRORS = """
class StagerError(Exception): pass
class StagingFailed(StagerError): pass
class WaitTimeout(StagerError): pass
"""


def _stub_env(tmp_path, spec: dict) -> dict[str, str]:
    # The runs use cwd=tmp_path so the repository's own client/ does not shadow the stub.
    pkg = tmp_path / "stub" / "client"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(STUB_INIT)
    (pkg / "errors.py").write_text(STUB_ERRORS)
    spec = dict(spec, log=str(tmp_path / "waits.log"))
    return trainer_env(PYTHONPATH=f"{tmp_path / 'stub'}:{REPO}", STUB_STAGER=json.dumps(spec))


def _args(tmp_path):
    args = tiny_args(tmp_path / "out", "--epochs", "1", "--stager-wait", "imgs",
                     "--data-root", "tree", "--crop-size", "16")  # fmt: skip
    i = args.index("fake")
    args[i] = "imagefolder"
    return args


@pytest.mark.slow
def test_stager_wait_reads_the_staged_path(tmp_path):
    make_imagefolder(tmp_path / "staged" / "tree", "train", per_class=4)
    env = _stub_env(tmp_path, {"path": str(tmp_path / "staged")})
    done = run_trainer(_args(tmp_path), nproc=2, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "dataset 'imgs' ready at" in done.stderr
    # Local rank 0 waits first; rank 1 asks only once the data is ready.
    assert open(tmp_path / "waits.log").read().split() == ["imgs", "0", "imgs", "1"]


def test_staging_failure_is_one_clear_line(tmp_path):
    sentence = "source /network/inat/train.tar.gz does not exist; check --source"
    env = _stub_env(tmp_path, {"fail": sentence})
    done = run_trainer(_args(tmp_path), env=env, cwd=tmp_path)
    assert done.returncode == 1
    assert f"dataset 'imgs' is not available: {sentence}" in done.stderr
    assert "Traceback" not in done.stderr


def test_real_client_api():
    client = pytest.importorskip("client", reason="client not available yet")
    if not hasattr(client, "StagerClient"):
        pytest.skip("client not available yet")
    errors = pytest.importorskip("client.errors", reason="client not available yet")
    assert issubclass(errors.StagingFailed, errors.StagerError)
    assert issubclass(errors.WaitTimeout, errors.StagerError)


# ----------------------------------------------------------------- long stagings


def _slow_stager_worker(rank: int, port: int, out: str, stage_s: float, timeout: float) -> None:
    import torch
    import torch.distributed as dist

    from trainer import staging
    from trainer.distributed import World

    torch.set_num_threads(1)
    # A 2 s default group stands in for the real 30 minutes: shorter than the staging.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=2))  # fmt: skip

    def slow_wait(name: str, timeout: float) -> Path:
        if rank == 0:  # the daemon call of local rank 0 (which ignores its timeout here)
            time.sleep(stage_s)
        return Path("/staged") / name

    staging._wait = slow_wait  # the daemon's side is covered by the tests above
    staging.WAIT_GRACE_S = 1.0
    try:
        world = World(rank=rank, local_rank=rank, world_size=2)
        result = str(staging.wait_for_dataset("imgs", timeout, world))
    except staging.StagingError as exc:
        result = f"error: {exc}"
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}").write_text(result)


def _spawn_slow_stager(tmp_path, stage_s: float, timeout: float) -> list[str]:
    import torch.multiprocessing as mp

    mp.spawn(_slow_stager_worker, args=(free_port(), str(tmp_path), stage_s, timeout), nprocs=2)
    return [(tmp_path / f"rank{r}").read_text() for r in range(2)]


@pytest.mark.slow
def test_other_ranks_outwait_the_default_group_timeout(tmp_path):
    # Staging takes 4 s, twice the default group's timeout, within --stager-timeout.
    assert _spawn_slow_stager(tmp_path, stage_s=4, timeout=10) == ["/staged/imgs"] * 2


@pytest.mark.slow
def test_a_stuck_stager_wait_names_the_flag(tmp_path):
    rank0, rank1 = _spawn_slow_stager(tmp_path, stage_s=5, timeout=1)
    assert rank1.startswith("error: gave up after 2s") and "--stager-timeout" in rank1
    assert rank0.startswith("error:")  # its peer is gone: no hang
