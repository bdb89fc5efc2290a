"""--stager-wait against a real daemon and the real client: the staged path, the
staged usage as the dataset, and failures as one clear line.

(These tests replaced a stand-in ``client`` package that had drifted from the
real one: the trainer passed an argument the stand-in did not take, so every
stand-in test failed, while the one test meant to check the real API only
asserted two class relationships and could not fail.)
"""

from __future__ import annotations

import datetime
import os
import subprocess
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daemon import Daemon, stage_ready
from tests.trainer.conftest import (
    REPO,
    finish,
    fork_ranks,
    free_port,
    make_imagefolder,
    run_trainer,
    start_trainer,
    tiny_args,
    trainer_command,
    trainer_env,
)
from trainer.datasets import DataConfig, build_dataset, split_of

pytestmark = pytest.mark.forked_daemons  # its daemons: tests/daemon_zygote.py


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """One daemon for the module: each test stages under a name of its own and waits
    for it to end (a start is 1.5-3 s of a CI worker)."""
    shared = Daemon(cache_dir=tmp_path_factory.mktemp("staging") / "cache")
    try:
        yield shared.start()
    finally:
        shared.cleanup()


def _args(out: Path, *extra: str, name: str = "imgs") -> list[str]:
    args = tiny_args(out, "--epochs", "1", "--stager-wait", name, *extra)
    for flag in ("--dataset", "--num-classes"):  # the staged usage says what to build
        i = args.index(flag)
        del args[i : i + 2]
    return args


def test_stager_wait_builds_the_dataset_from_the_staged_usage(tmp_path, daemon):
    source = make_imagefolder(tmp_path / "src", "train", per_class=4)
    make_imagefolder(source, "val", per_class=2)
    with daemon.client() as client:
        body = {"name": "imgs", "recipe": "imagefolder", "source": str(source),
                "params": {"splits": ["train", "val"]}}  # fmt: skip
        staged = stage_ready(client, body)
    assert [split_of(u.model_dump(by_alias=True)) for u in staged.usage] == ["train", "val"]
    done = run_trainer(_args(tmp_path / "out"), env=trainer_env(STAGER_URL=daemon.url))
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"dataset 'imgs' ready at {staged.path}" in done.stderr
    # ImageFolder(root/train) and ImageFolder(root/val), read from the daemon's answer.
    assert "torchvision.datasets.ImageFolder(root/train)" in done.stderr
    assert "train=12 val=6 classes=3" in done.stderr
    assert "HTTP Request" not in done.stderr  # httpx's INFO lines stay out of the log


@pytest.mark.skipif(os.geteuid() != 0, reason="an image dataset is mounted by the kernel")
def test_the_trainer_trains_on_an_image_dataset(tmp_path, daemon):
    """The same run on a dataset staged as one read-only image (docs/image-mode.md):
    torchvision reads it through the mount, by the same names."""
    source = make_imagefolder(tmp_path / "src", "train", per_class=4)
    make_imagefolder(source, "val", per_class=2)
    archive = tmp_path / "src.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(source, arcname=".")
    with daemon.client() as client:
        body = {"name": "imgs-image", "recipe": "imagefolder", "source": str(archive),
                "params": {"splits": ["train", "val"]}, "image": True}  # fmt: skip
        staged = stage_ready(client, body)
    assert staged.image is not None and os.path.ismount(staged.path)
    args = _args(tmp_path / "out", name="imgs-image")
    done = run_trainer(args, env=trainer_env(STAGER_URL=daemon.url))
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"dataset 'imgs-image' ready at {staged.path}" in done.stderr
    assert "train=12 val=6 classes=3" in done.stderr


def test_stager_wait_started_before_the_request_waits_for_it(tmp_path, daemon):
    # In a job script the trainer and the stage request race; the trainer may win.
    source = make_imagefolder(tmp_path / "src", "train", per_class=2)
    args = _args(tmp_path / "out", "--no-eval", name="late")
    log = tmp_path / "trainer.log"
    env = trainer_env(STAGER_URL=daemon.url)
    with open(log, "w") as err:
        proc = subprocess.Popen(trainer_command(args), cwd=REPO, env=env, text=True,
                                stderr=err, stdout=subprocess.DEVNULL)  # fmt: skip
        try:
            deadline = time.monotonic() + 120
            while "not been requested yet" not in log.read_text():
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
            with daemon.client() as client:
                body = {"name": "late", "recipe": "imagefolder", "source": str(source),
                        "params": {"splits": ["train"]}}  # fmt: skip
                stage_ready(client, body)
            proc.wait(timeout=240)
        finally:
            proc.kill()
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    assert text.count("'late' has not been requested yet") == 1, text[-3000:]  # said once
    assert "train=6 val=- classes=3" in text


def test_raw_steps_fall_back_to_dataset_flag(tmp_path, daemon):
    make_imagefolder(tmp_path / "src", "train", per_class=2)
    with daemon.client() as client:
        steps = [{"op": "copy", "src": str(tmp_path / "src"), "dst": "tree"}]
        stage_ready(client, {"name": "raw", "steps": steps})
    env = trainer_env(STAGER_URL=daemon.url)
    args = _args(tmp_path / "out", "--dataset", "imagefolder", "--data-root", "tree", name="raw")
    failed, done = finish(  # side by side: without --dataset (no usage to go by), and with it
        [start_trainer(_args(tmp_path / "refused", name="raw"), env=env),
         start_trainer(args, env=env)]
    )  # fmt: skip
    assert failed.returncode == 1
    assert "carries no torchvision usage" in failed.stderr and "pass --dataset" in failed.stderr
    assert "Traceback" not in failed.stderr
    assert done.returncode == 0, done.stderr[-3000:]
    assert "data: imagefolder train=6" in done.stderr


def test_staging_failure_is_one_clear_line(tmp_path, daemon):
    # An archive cut short: its header passes admission, the staging then fails.
    make_imagefolder(tmp_path / "src", "train", per_class=20)
    archive = tmp_path / "imgs.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(tmp_path / "src", arcname="src")
    archive.write_bytes(archive.read_bytes()[: archive.stat().st_size * 6 // 10])
    with daemon.client() as client:
        steps = [{"op": "extract", "src": str(archive)}]
        assert client.post("/v1/datasets", json={"name": "cut", "steps": steps}).status_code == 202
    done = run_trainer(_args(tmp_path / "out", "--dataset", "imagefolder", name="cut"),
                       env=trainer_env(STAGER_URL=daemon.url))  # fmt: skip
    assert done.returncode == 1, done.stderr[-3000:]
    line = [x for x in done.stderr.splitlines() if "stager-train train: error:" in x]
    assert len(line) == 1 and "dataset 'cut' is not available" in line[0], done.stderr
    assert str(archive) in line[0]  # the daemon's sentence names the input at fault
    assert "Traceback" not in done.stderr


def test_usage_splits_are_recognised():
    train = [
        {"class": "torchvision.datasets.ImageNet", "kwargs": {"split": "train"}},
        {"class": "torchvision.datasets.CIFAR10", "kwargs": {"train": True}},
        {"class": "torchvision.datasets.INaturalist", "kwargs": {"version": "2021_train_mini"}},
        {"class": "torchvision.datasets.INaturalist", "kwargs": {"version": "2019"}},
        {"class": "torchvision.datasets.ImageFolder", "root": "."},
    ]
    val = [
        {"class": "torchvision.datasets.ImageNet", "kwargs": {"split": "val"}},
        {"class": "torchvision.datasets.CIFAR100", "kwargs": {"train": False}},
        {"class": "torchvision.datasets.INaturalist", "kwargs": {"version": "2021_valid"}},
        {"class": "torchvision.datasets.ImageFolder", "root": "val"},
    ]
    assert [split_of(u) for u in train] == ["train"] * len(train)
    assert [split_of(u) for u in val] == ["val"] * len(val)


def test_usage_outside_torchvision_is_refused(tmp_path):
    usage = ({"class": "os.system", "kwargs": {}, "root": "."},)
    cfg = DataConfig(dataset=None, root=tmp_path, usage=usage)
    with pytest.raises(RuntimeError, match="not a torchvision.datasets class"):
        build_dataset(cfg, "train", None)


# ----------------------------------------------------------------- long stagings


def _slow_stager_worker(rank: int, port: int, out: str, stage_s: float, timeout: float) -> None:
    import torch
    import torch.distributed as dist

    from trainer import staging
    from trainer.distributed import World

    torch.set_num_threads(1)
    # A 2 s default group stands in for the real 30 minutes: shorter than the staging.
    # The rendezvous has a store of its own with a long timeout: on a busy machine
    # one process may start seconds after the other.
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=120))  # fmt: skip
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=2))  # fmt: skip

    def slow_wait(name: str, timeout: float) -> staging.Staged:
        if rank == 0:  # the daemon call of local rank 0 (which ignores its timeout here)
            time.sleep(stage_s)
        return staging.Staged(Path("/staged") / name)

    staging._wait = slow_wait  # the collectives are under test here, not the daemon
    staging.WAIT_GRACE_S = 1.0
    try:
        world = World(rank=rank, local_rank=rank, world_size=2)
        result = str(staging.wait_for_dataset("imgs", timeout, world).path)
    except staging.StagingError as exc:
        result = f"error: {exc}"
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}").write_text(result)


def _spawn_slow_stager(tmp_path, stage_s: float, timeout: float) -> list[str]:
    fork_ranks(_slow_stager_worker, (free_port(), str(tmp_path), stage_s, timeout))
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
