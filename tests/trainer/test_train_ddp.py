"""End-to-end runs with real 2-process gloo groups (torchrun, or ranks forked from this
process: `fork_ranks`, `ForkedTrainer`, where the claim is not torchrun's)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torchvision import datasets as tvd

from bench.fakedata import make_inat2021 as make_inat_release
from tests.trainer.conftest import (
    ForkedTrainer,
    finish_forked,
    fork_ranks,
    free_port,
    run_forked_trainer,
    run_trainer,
    tiny_args,
    trainer_env,
)
from trainer import checkpoint, data, datasets, engine, transforms
from trainer.models import build_model

pytestmark = pytest.mark.slow


def _epochs(out: Path) -> list[dict[str, str]]:
    with open(out / "epochs.csv") as f:
        return list(csv.DictReader(f))


def _final_model(out: Path) -> dict[str, torch.Tensor]:
    return checkpoint.load(checkpoint.latest(out / "checkpoints"))["model"]


def _resnet_args(out: Path, *extra: str) -> list[str]:
    return [
        "--arch", "resnet18", "--device", "cpu", "--workers", "1", "--batch-size", "8",
        "--crop-size", "16", "--val-resize-size", "16", "--opt", "adamw", "--lr", "0.002",
        "--weight-decay", "0", "--no-tensorboard", "--print-freq", "1000",
        "--output-dir", str(out), *extra,
    ]  # fmt: skip


def test_resnet_trains_on_fakedata_ddp(tmp_path):
    # FakeData is noise with random labels: only memorisation can lower the
    # loss, so augmentation is off and the check is on the training loss.
    # No loader workers (test_resume and the run below have them): each rank's would
    # come from a forkserver, one more interpreter importing torch.
    args = _resnet_args(
        tmp_path, "--dataset", "fake", "--fake-size", "32", "--fake-val-size", "9",
        "--fake-image-size", "16", "--num-classes", "4", "--augment", "none", "--epochs", "4",
        "--workers", "0",
    )  # fmt: skip
    done = run_trainer(args, nproc=2)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = _epochs(tmp_path)
    assert len(rows) == 4 and rows[0]["count"] == "9"
    assert float(rows[-1]["train_loss"]) < 0.6 * float(rows[0]["train_loss"])
    assert "via torchrun" in done.stderr and "img/s" in done.stderr
    # The 2-rank evaluation scored exactly the model in the final checkpoint.
    cfg = datasets.DataConfig(dataset="fake", root=tmp_path, fake_val_size=9, fake_image_size=16,
                          fake_classes=4)  # fmt: skip
    val = data.Indexed(
        datasets.build_dataset(cfg, "val", transforms.eval_transform("fast", 16, 16))
    )
    model = build_model("resnet18", 4)
    model.load_state_dict(_final_model(tmp_path))
    loader = data.make_loader(val, data.ShardedEvalSampler(9, 1, 0), 8, 0, False, False)
    cpu = torch.device("cpu")
    single = engine.evaluate(model, loader, transforms.DeviceNormalize(cpu), cpu, 4)
    assert float(rows[-1]["val_loss"]) == pytest.approx(single["val_loss"], rel=1e-6)
    assert float(rows[-1]["top1"]) == single["top1"]


def test_resnet_trains_on_fake_inaturalist_staged_by_the_daemon(tmp_path, daemon):
    # The release archives as the cluster stores them, staged by a real daemon with the
    # inat2021 recipe; the trainer finds the data through --stager-wait (the real client).
    shared = tmp_path / "shared"
    make_inat_release(shared, classes=4, per_class={"train": 8, "val": 3}, size=(32, 24))
    with daemon.client() as client:
        body = {"name": "inat", "recipe": "inat2021", "source": str(shared)}
        assert client.post("/v1/datasets", json=body).status_code == 202
    args = _resnet_args(
        tmp_path / "out", "--dataset", "inat2021", "--stager-wait", "inat", "--data-root", ".",
        "--epochs", "6",
    )  # fmt: skip
    args.remove("--no-tensorboard")  # this run also writes TensorBoard events
    done = run_forked_trainer(args, nproc=2, env=trainer_env(STAGER_URL=daemon.url))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = _epochs(tmp_path / "out")
    assert rows[0]["count"] == "12"  # 4 classes x 3 validation images, each once
    assert float(rows[-1]["train_loss"]) < 0.7 * float(rows[0]["train_loss"])
    assert float(rows[-1]["top1"]) > 0.25  # better than chance with 4 classes
    assert list((tmp_path / "out" / "tensorboard").glob("events.out.tfevents.*"))


# ----------------------------------------------------------------- exact evaluation


def _eval_setup(batch_size: int):
    torch.manual_seed(0)
    model = build_model("tinynet", 5)
    # 21 samples: not divisible by 2, and the last batches differ in size.
    val = data.Indexed(tvd.FakeData(21, (3, 16, 16), 5, transforms.eval_transform("fast", 16, 16)))
    return model, val


def _eval_worker(rank: int, world: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)  # fmt: skip
    try:
        model, val = _eval_setup(4)
        sampler = data.ShardedEvalSampler(len(val), world, rank)
        loader = data.make_loader(val, sampler, 4, 0, False, drop_last=False)
        cpu = torch.device("cpu")
        metrics = engine.evaluate(model, loader, transforms.DeviceNormalize(cpu), cpu, 5)
        if rank == 0:
            Path(out).write_text(json.dumps(metrics))
    finally:
        dist.destroy_process_group()


def test_distributed_eval_equals_single_process(tmp_path):
    model, val = _eval_setup(4)
    loader = data.make_loader(val, data.ShardedEvalSampler(21, 1, 0), 4, 0, False, False)
    cpu = torch.device("cpu")
    single = engine.evaluate(model, loader, transforms.DeviceNormalize(cpu), cpu, 5)
    out = tmp_path / "dist.json"
    fork_ranks(_eval_worker, (2, free_port(), str(out)))
    distributed = json.loads(out.read_text())
    assert distributed["count"] == single["count"] == 21
    for key in ("top1", "top5", "mean_class_acc"):
        assert distributed[key] == single[key], key
    assert distributed["val_loss"] == pytest.approx(single["val_loss"], rel=1e-6)


def _bn_worker(rank: int, world: int, port: int, out: str) -> None:
    # A ResNet after a few DDP steps: each rank's BatchNorm running stats were
    # last updated by its own batch, so without a buffer broadcast every rank
    # would evaluate a different model.
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)  # fmt: skip
    try:
        torch.manual_seed(0)
        model = build_model("resnet18", 5)
        train = data.Indexed(
            tvd.FakeData(48, (3, 16, 16), 5, transforms.eval_transform("fast", 16, 16))
        )
        sampler = data.ResumableSampler(data.EpochOrder(48, 0), world, rank, 4)
        loader = data.make_loader(train, sampler, 4, 0, False, drop_last=True)
        cpu = torch.device("cpu")
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        cfg = engine.StepConfig(max_samples=3 * 4 * world, print_freq=1000, global_batch=4 * world)
        parts = engine.Parts(ddp, model, torch.nn.CrossEntropyLoss(), opt,
                             transforms.DeviceNormalize(cpu), cpu)  # fmt: skip
        engine.train_one_epoch(parts, loader, engine.Position(), cfg, engine.Hooks(), world)
        _, val = _eval_setup(4)
        val_loader = data.make_loader(val, data.ShardedEvalSampler(len(val), world, rank), 4, 0,
                                      False, drop_last=False)  # fmt: skip
        metrics = engine.evaluate(model, val_loader, transforms.DeviceNormalize(cpu), cpu, 5)
        if rank == 0:  # what the trainer's checkpoint holds: rank 0's model
            torch.save(model.state_dict(), Path(out) / "model.pt")
            (Path(out) / "dist.json").write_text(json.dumps(metrics))
    finally:
        dist.destroy_process_group()


def test_distributed_eval_of_batchnorm_model_equals_saved_model(tmp_path):
    fork_ranks(_bn_worker, (2, free_port(), str(tmp_path)))
    distributed = json.loads((tmp_path / "dist.json").read_text())
    model = build_model("resnet18", 5)
    model.load_state_dict(torch.load(tmp_path / "model.pt"))
    _, val = _eval_setup(4)
    loader = data.make_loader(val, data.ShardedEvalSampler(21, 1, 0), 4, 0, False, False)
    cpu = torch.device("cpu")
    single = engine.evaluate(model, loader, transforms.DeviceNormalize(cpu), cpu, 5)
    assert distributed["count"] == single["count"] == 21
    assert distributed["val_loss"] == pytest.approx(single["val_loss"], rel=1e-6)
    for key in ("top1", "top5", "mean_class_acc"):
        assert distributed[key] == single[key], key


def test_gradient_accumulation_equals_larger_batch(tmp_path):
    common = ["--iterations", "4", "--no-eval", "--lr", "0.1"]
    runs = [  # side by side: neither result depends on timing
        ForkedTrainer(tiny_args(tmp_path / "micro", *common, "--batch-size", "4",
                                "--accum-steps", "3"), nproc=2),
        ForkedTrainer(tiny_args(tmp_path / "big", *common, "--batch-size", "12"), nproc=2),
    ]  # fmt: skip
    micro, big = finish_forked(runs)
    assert micro.returncode == 0, micro.stderr[-3000:]
    assert big.returncode == 0, big.stderr[-3000:]
    a, b = _final_model(tmp_path / "micro"), _final_model(tmp_path / "big")
    start = build_model("tinynet", 4).state_dict()
    for key in a:
        assert torch.allclose(a[key], b[key], atol=1e-6), key
    assert not torch.allclose(a["fc.weight"], start["fc.weight"])  # it did train


def test_lr_finder_writes_csv_png_and_suggestion(tmp_path):
    args = tiny_args(tmp_path, "--min-lr", "1e-4", "--max-lr", "10", "--num-runs", "6",
                     "--iters-per-run", "2")  # fmt: skip
    for flag in ("--print-freq", "1000", "--no-tensorboard"):  # train-only flags
        args.remove(flag)
    done = run_forked_trainer(["find-lr", *args], nproc=2)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "lr_find.csv")))
    assert 3 <= len(rows) <= 6 and float(rows[0]["lr"]) == pytest.approx(1e-4)
    assert (tmp_path / "lr_find.png").read_bytes()[:4] == b"\x89PNG"
    assert done.stdout.count("suggested LR:") == 1  # rank 0 only
