from __future__ import annotations

import pytest
import torch

from trainer.models import TinyNet, build_model
from trainer.optim import Schedule, build_optimizer, make_param_groups, parse_overrides


def _groups_by_name(model, groups):
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: (g["lr"], g["weight_decay"]) for g in groups for p in g["params"]}


def test_param_groups_overrides_and_weight_decay_per_kind():
    model = build_model("resnet18", 5)
    overrides = parse_overrides(["fc.*=0.01", "conv1.weight=0.5"])
    groups = make_param_groups(model, 0.1, 1e-4, overrides, norm_weight_decay=0.0)
    got = _groups_by_name(model, groups)
    assert got["fc.weight"] == (0.01, 1e-4)
    assert got["fc.bias"] == (0.01, 1e-4)  # a bias outside a norm layer: the common decay
    assert got["conv1.weight"] == (0.5, 1e-4)
    assert got["bn1.weight"] == (0.1, 0.0) and got["layer1.0.bn1.bias"] == (0.1, 0.0)
    assert got["layer4.1.conv2.weight"] == (0.1, 1e-4)
    assert len(got) == len(list(model.parameters()))
    both = _groups_by_name(model, make_param_groups(model, 0.1, 1e-4, None, 0.0, 0.0))
    assert both["fc.bias"] == (0.1, 0.0) and both["fc.weight"] == (0.1, 1e-4)


@pytest.mark.parametrize("exempt", [False, True])
def test_no_decay_on_norms_and_biases_leaves_them_untouched(exempt):
    # The effect, through a real optimizer step: with zero gradients only weight
    # decay moves a parameter.
    model = build_model("resnet18", 5)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0)
    decay = 0.0 if exempt else None
    groups = make_param_groups(model, 0.1, 0.5, None, norm_weight_decay=decay,
                               bias_weight_decay=decay)  # fmt: skip
    opt = build_optimizer("sgd", groups, 0.1, 0.0, 0.5)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    moved = {n for n, p in model.named_parameters() if not torch.all(p == 1.0)}
    norms_and_biases = {n for n, _ in model.named_parameters() if "bn" in n or "downsample.1" in n}
    norms_and_biases |= {"fc.bias"}
    assert "conv1.weight" in moved and "fc.weight" in moved
    if exempt:
        assert moved.isdisjoint(norms_and_biases)
    else:
        assert norms_and_biases <= moved


def test_unknown_override_names_the_pattern():
    with pytest.raises(ValueError, match="nosuch"):
        make_param_groups(TinyNet(), 0.1, 0.0, {"nosuch.weight": 1.0})
    with pytest.raises(ValueError, match="NAME=LR"):
        parse_overrides(["fc.weight"])


def test_warmup_then_cosine_in_fractional_epochs():
    s = Schedule("cosine", total=11.0, warmup=1.0, warmup_decay=0.1)
    f = [s.factor(t / 10) for t in range(111)]  # progress 0.0, 0.1, ... 11.0 epochs
    assert f[0] == pytest.approx(0.1) and f[5] == pytest.approx(0.55) and f[10] == 1.0
    assert f[60] == pytest.approx(0.5) and f[110] == pytest.approx(0.0, abs=1e-12)
    assert all(a >= b for a, b in zip(f[10:], f[11:], strict=False))


@pytest.mark.parametrize("method", ["linear", "constant"])
def test_per_epoch_schedule_equals_torchvision_reference_schedulers(method):
    # torchvision's train.py: SequentialLR(LinearLR|ConstantLR, CosineAnnealingLR), stepped
    # once per epoch. The same curve from our function of progress, mid-epoch included.
    epochs, warmup, decay = 12, 3, 0.01
    opt = torch.optim.SGD(TinyNet().parameters(), lr=0.5)
    first = (
        torch.optim.lr_scheduler.LinearLR(opt, start_factor=decay, total_iters=warmup)
        if method == "linear"
        else torch.optim.lr_scheduler.ConstantLR(opt, factor=decay, total_iters=warmup)
    )
    main = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs - warmup)
    reference = torch.optim.lr_scheduler.SequentialLR(opt, [first, main], milestones=[warmup])
    ours = Schedule("cosine", total=epochs, warmup=warmup, warmup_method=method,
                    warmup_decay=decay, per_epoch=True)  # fmt: skip
    for epoch in range(epochs):
        expected = opt.param_groups[0]["lr"]
        for within in (0.0, 0.5, 0.99):
            assert 0.5 * ours.factor(epoch + within) == pytest.approx(expected, abs=1e-12)
        opt.step()
        reference.step()


def test_step_schedule_and_apply_keeps_per_group_ratios():
    model = TinyNet()
    groups = make_param_groups(model, 1.0, 0.0, {"fc.*": 0.1})
    opt = build_optimizer("sgd", groups, 1.0, 0.9, 0.0)
    s = Schedule("step", total=100, step_size=10, gamma=0.5)
    assert s.apply(opt, 24.9) == 0.25
    lrs = sorted(g["lr"] for g in opt.param_groups)
    assert lrs == pytest.approx([0.025, 0.25])


def test_unknown_schedule_names_the_choices():
    with pytest.raises(ValueError, match="cosineannealinglr"):
        Schedule("linear", total=1)
