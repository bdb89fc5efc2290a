from __future__ import annotations

import math

import pytest
import torch

from trainer.models import TinyNet, build_model
from trainer.optim import build_scheduler, lr_factor, make_param_groups, parse_overrides


def _groups_by_name(model, groups):
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: (g["lr"], g["weight_decay"]) for g in groups for p in g["params"]}


def test_param_groups_overrides_and_no_decay_on_norm_and_bias():
    model = build_model("resnet18", 5)
    groups = make_param_groups(model, 0.1, 1e-4, parse_overrides(["fc.*=0.01", "conv1.weight=0.5"]))
    got = _groups_by_name(model, groups)
    assert got["fc.weight"] == (0.01, 1e-4)
    assert got["fc.bias"] == (0.01, 0.0)
    assert got["conv1.weight"] == (0.5, 1e-4)
    assert got["bn1.weight"] == (0.1, 0.0) and got["layer1.0.bn1.bias"] == (0.1, 0.0)
    assert got["layer4.1.conv2.weight"] == (0.1, 1e-4)
    assert len(got) == len(list(model.parameters()))


def test_unknown_override_names_the_pattern():
    with pytest.raises(ValueError, match="nosuch"):
        make_param_groups(TinyNet(), 0.1, 0.0, {"nosuch.weight": 1.0})
    with pytest.raises(ValueError, match="NAME=LR"):
        parse_overrides(["fc.weight"])


def test_warmup_then_cosine():
    f = [lr_factor(s, 110, 10, 0.1, "cosine", 0, 0, 0.0) for s in range(111)]
    assert f[0] == pytest.approx(0.1) and f[5] == pytest.approx(0.55) and f[10] == 1.0
    assert f[60] == pytest.approx(0.5) and f[110] == pytest.approx(0.0, abs=1e-12)
    assert all(a >= b for a, b in zip(f[10:], f[11:], strict=False))


def test_step_schedule_with_scheduler_object():
    opt = torch.optim.SGD(TinyNet().parameters(), lr=1.0)
    sched = build_scheduler(opt, "step", total=100, warmup=0, step_size=10, gamma=0.5)
    lrs = []
    for _ in range(25):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[9] == 1.0 and lrs[10] == 0.5 and lrs[24] == 0.25
    assert not math.isnan(lrs[-1])
