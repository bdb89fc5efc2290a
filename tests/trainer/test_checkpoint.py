from __future__ import annotations

import torch

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
