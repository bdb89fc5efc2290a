from __future__ import annotations

import pytest
import torch

from tests.trainer.conftest import run_trainer, tiny_args
from trainer import checkpoint
from trainer.metrics import Throughput


def _state(samples: int) -> dict:
    return {"position": {"epoch": 0, "samples_in_epoch": samples, "samples": samples,
                         "iteration": samples // 4},
            "model": {"w": torch.full((2,), float(samples))}}  # fmt: skip


def _names(directory) -> list[tuple[int, int]]:
    return [(e.attempt, e.samples) for e in checkpoint.entries(directory)]


def test_atomic_save_latest_and_keep(tmp_path):
    for samples in (40, 80, 120):
        checkpoint.save(_state(samples), tmp_path, attempt=1, keep=2)
    (tmp_path / "checkpoint-a0001-s0000000009999.pt.tmp").write_bytes(b"half written")
    assert _names(tmp_path) == [(1, 80), (1, 120)]
    assert checkpoint.load(checkpoint.latest(tmp_path))["model"]["w"][0] == 120
    assert checkpoint.latest(tmp_path / "missing") is None
    assert checkpoint.next_attempt(tmp_path) == 2 and checkpoint.next_attempt(tmp_path / "x") == 1


def test_a_fresh_run_in_an_old_folder_keeps_its_own_checkpoints(tmp_path):
    # The old pruning kept the highest-numbered files: a run restarted without
    # --resume had each new (lower-numbered) checkpoint deleted as it was written.
    for samples in (400, 800):
        checkpoint.save(_state(samples), tmp_path, attempt=1, keep=2)
    checkpoint.save(_state(8), tmp_path, attempt=2, keep=2)
    assert _names(tmp_path) == [(1, 800), (2, 8)]
    assert checkpoint.load(checkpoint.latest(tmp_path))["model"]["w"][0] == 8
    checkpoint.save(_state(16), tmp_path, attempt=2, keep=2)
    assert _names(tmp_path) == [(2, 8), (2, 16)]


def test_load_latest_falls_back_over_an_unreadable_file(tmp_path, caplog):
    checkpoint.save(_state(40), tmp_path, attempt=1, keep=3)
    newest = checkpoint.save(_state(80), tmp_path, attempt=1, keep=3)
    newest.write_bytes(newest.read_bytes()[:100])  # lost its tail under a crash
    path, state = checkpoint.load_latest(tmp_path)
    assert state["position"]["samples"] == 40 and path != newest
    assert f"checkpoint {newest} cannot be read" in caplog.text
    assert checkpoint.load_latest(tmp_path / "none") is None


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


def _final(out) -> dict:
    return checkpoint.load(checkpoint.latest(out / "checkpoints"))


@needs_cuda
def test_resume_on_gpu_is_exact(tmp_path):
    # CUDA generators reseeded per step (dropout, mixup draws): a run cut in two on
    # the GPU ends with the weights of the uninterrupted one.
    common = ["--device", "cuda", "--no-eval", "--deterministic", "--mixup-alpha", "0.4",
              "--cutmix-alpha", "1.0", "--model-ema", "--model-ema-steps", "1"]  # fmt: skip
    whole = run_trainer([*tiny_args(tmp_path / "whole", *common), "--iterations", "4"],
                        env=None)  # fmt: skip
    assert whole.returncode == 0, whole.stderr[-3000:]
    cut = tmp_path / "cut"
    first = run_trainer([*tiny_args(cut, *common), "--iterations", "4",
                         "--debug-signal-at-iter", "2"])  # fmt: skip
    assert first.returncode == 75, first.stderr[-3000:]
    second = run_trainer([*tiny_args(cut, *common), "--iterations", "4", "--resume"])
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stderr
    a, b = _final(tmp_path / "whole"), _final(cut)
    assert a["position"] == b["position"] and b["position"]["iteration"] == 4
    for part in ("model", "model_ema"):
        for key, value in a[part].items():
            assert torch.equal(value, b[part][key]), (part, key)
