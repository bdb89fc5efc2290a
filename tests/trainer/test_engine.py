"""train_one_epoch's stopping rules, in one process."""

from __future__ import annotations

import pytest
import torch
from torchvision import datasets as tvd

from tests.trainer.conftest import run_forked_trainer, tiny_args
from trainer import checkpoint, data, engine, transforms
from trainer.models import build_model


def _epoch(pos: engine.Position, max_iters: int) -> tuple[engine.EpochResult, torch.nn.Module]:
    torch.manual_seed(0)
    model = build_model("tinynet", 3)
    tf = transforms.eval_transform("fast", 16, 16)
    train = data.Indexed(tvd.FakeData(24, (3, 16, 16), 3, tf))
    sampler = data.ResumableSampler(data.EpochOrder(24, 0), 1, 0, 4)
    sampler.set_start(pos.samples_in_epoch)
    loader = data.make_loader(train, sampler, 4, 0, False, drop_last=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cpu = torch.device("cpu")
    cfg = engine.StepConfig(max_samples=max_iters * 4, print_freq=1000, global_batch=4)
    parts = engine.Parts(model, model, torch.nn.CrossEntropyLoss(), opt,
                         transforms.DeviceNormalize(cpu), cpu)  # fmt: skip
    result = engine.train_one_epoch(parts, loader, pos, cfg, engine.Hooks())
    return result, model


def test_max_iters_stops_after_the_last_step():
    pos = engine.Position()
    result, _ = _epoch(pos, max_iters=2)
    assert result.stopped == "max_iters" and pos.iteration == 2


def test_a_position_at_max_iters_takes_no_step():
    # What a --resume of a finished run hands the loop.
    pos = engine.Position(epoch=0, samples_in_epoch=8, samples=8, iteration=2)
    result, model = _epoch(pos, max_iters=2)
    torch.manual_seed(0)
    untouched = build_model("tinynet", 3).state_dict()
    assert result.stopped == "max_iters" and pos.iteration == 2 and pos.samples == 8
    for key, value in model.state_dict().items():
        assert torch.equal(value, untouched[key]), key


@pytest.mark.slow
def test_resuming_a_finished_run_trains_nothing(tmp_path):
    args = tiny_args(tmp_path, "--iterations", "3", "--no-eval")
    done = run_forked_trainer(args)
    assert done.returncode == 0, done.stderr[-3000:]
    before = checkpoint.load(checkpoint.latest(tmp_path / "checkpoints"))
    done = run_forked_trainer([*args, "--resume"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "nothing to train" in done.stderr
    after = checkpoint.load(checkpoint.latest(tmp_path / "checkpoints"))
    assert after["position"] == before["position"] and after["position"]["iteration"] == 3
    for key, value in after["model"].items():
        assert torch.equal(value, before["model"][key]), key
