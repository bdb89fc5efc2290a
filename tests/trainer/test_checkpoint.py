from __future__ import annotations

import pytest
import torch

from tests.trainer.conftest import run_trainer, tiny_args
from trainer import checkpoint
from trainer.metrics import Throughput


def _state(iteration: int) -> dict:
    return {"position": {"epoch": 0, "batch_in_epoch": 0, "iteration": iteration},
            "model": {"w": torch.full((2,), float(iteration))}}  # fmt: skip


def test_atomic_save_latest_and_keep(tmp_path):
    for it in (5, 10, 15):
        checkpoint.save(_state(it), tmp_path, keep=2)
    (tmp_path / "checkpoint-000000099.pt.tmp").write_bytes(b"half written")
    names = [p.name for p in checkpoint.all_checkpoints(tmp_path)]
    assert names == ["checkpoint-000000010.pt", "checkpoint-000000015.pt"]
    latest = checkpoint.latest(tmp_path)
    assert checkpoint.load(latest)["model"]["w"][0] == 15
    assert checkpoint.latest(tmp_path / "missing") is None


def test_rng_roundtrip():
    state = checkpoint.rng_state()
    a = torch.rand(3)
    checkpoint.restore_rng(state)
    assert torch.equal(a, torch.rand(3))


def test_throughput_with_fake_clock():
    now = [0.0]
    meter = Throughput(clock=lambda: now[0])
    for rate in (999, 100, 300):  # the first interval (start-up) is not counted
        meter.add_images(rate)
        now[0] += 1.0
        meter.interval()
    meter.add_data_wait(0.75)
    now[0] += 1.0
    s = meter.summary()
    assert s["img_s_mean"] == 200 and round(s["img_s_std"], 3) == 141.421
    assert s["data_wait_pct"] == 0.75 / 4 * 100


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
def test_rng_restores_from_a_checkpoint_loaded_onto_the_gpu(tmp_path):
    torch.cuda.init()  # so rng_state() includes the CUDA generators
    path = checkpoint.save(dict(_state(1), rng=checkpoint.rng_state()), tmp_path)
    a, b = torch.rand(3), torch.rand(3, device="cuda")
    checkpoint.restore_rng(checkpoint.load(path, map_location="cuda")["rng"])
    assert torch.equal(a, torch.rand(3)) and torch.equal(b, torch.rand(3, device="cuda"))


@needs_cuda
def test_resume_on_gpu(tmp_path):
    # Saved CUDA-side, reloaded: the RNG states must come back as CPU tensors.
    args = tiny_args(tmp_path, "--device", "cuda", "--no-eval")  # the later --device wins
    done = run_trainer([*args, "--iterations", "2"])
    assert done.returncode == 0, done.stderr[-3000:]
    done = run_trainer([*args, "--iterations", "4", "--resume"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in done.stderr
    assert checkpoint.latest(tmp_path / "checkpoints").name == "checkpoint-000000004.pt"
