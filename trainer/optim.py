"""Optimizers, parameter groups (per-parameter LR, weight decay) and the LR schedule."""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn


def parse_overrides(items: list[str] | None) -> dict[str, float]:
    """``["fc.*=0.01", "conv1.weight=1e-4"]`` -> ``{"fc.*": 0.01, ...}``."""
    out: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.rpartition("=")
        if not sep or not name:
            raise ValueError(f"--lr-override {item!r} is not NAME=LR (e.g. fc.weight=0.01)")
        out[name] = float(value)
    return out


# torchvision references' norm_classes: every parameter of these layers is a "norm" one.
NORM_LAYERS = (
    nn.modules.batchnorm._BatchNorm,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.modules.instancenorm._InstanceNorm,
    nn.LocalResponseNorm,
)


def make_param_groups(
    model: nn.Module,
    lr: float,
    weight_decay: float,
    lr_overrides: Mapping[str, float] | None = None,
    norm_weight_decay: float | None = None,
    bias_weight_decay: float | None = None,
) -> list[dict]:
    """Group parameters by (lr, weight decay).

    ``lr_overrides`` maps a parameter name or glob ("layer4.*") to its own LR;
    the first matching pattern wins. Weight decay follows torchvision's
    ``--norm-weight-decay`` / ``--bias-weight-decay``: None means the common
    ``weight_decay``; a bias takes ``bias_weight_decay`` even inside a norm
    layer; ``0.0`` for both is "no decay on norms and biases", since decaying
    them only pulls the normalisation scale and the offsets towards zero.
    """
    lr_overrides = dict(lr_overrides or {})
    used: set[str] = set()
    groups: dict[tuple[float, float], dict] = {}
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            if not param.requires_grad:
                continue
            name = f"{module_name}.{param_name}" if module_name else param_name
            p_lr = lr
            for pattern, value in lr_overrides.items():
                if name == pattern or fnmatch.fnmatchcase(name, pattern):
                    p_lr = value
                    used.add(pattern)
                    break
            wd = weight_decay
            if param_name == "bias" and bias_weight_decay is not None:
                wd = bias_weight_decay
            elif isinstance(module, NORM_LAYERS) and norm_weight_decay is not None:
                wd = norm_weight_decay
            group = groups.setdefault((p_lr, wd), {"params": [], "lr": p_lr, "weight_decay": wd})
            group["params"].append(param)
    unused = sorted(set(lr_overrides) - used)
    if unused:
        raise ValueError(
            f"--lr-override {', '.join(unused)} matches no parameter; "
            f"names look like {next(iter(dict(model.named_parameters())), '?')!r}"
        )
    for group in groups.values():
        group["initial_lr"] = group["lr"]  # what the schedule scales
    return list(groups.values())


def build_optimizer(
    name: str, groups: list[dict], lr: float, momentum: float, weight_decay: float
) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}; choose sgd or adamw")


SCHEDULES = {"cosineannealinglr": "cosine", "steplr": "step", "constant": "constant"}


@dataclass(frozen=True)
class Schedule:
    """LR multiplier as a function of training progress, in epochs (a float).

    Progress is counted in samples: ``epoch + samples seen in this epoch /
    epoch length``, so it means the same thing whatever the world size, batch
    size or accumulation; a run resumed on fewer nodes continues the same
    curve. With ``per_epoch`` (``--sched-unit epoch``) the LR changes only at
    epoch boundaries, as torchvision's reference steps its schedulers: warmup
    (LinearLR from ``warmup_decay``, or ConstantLR at it) for ``warmup``
    epochs, then cosine to ``min_factor`` at ``total``, or steps of ``gamma``.
    """

    kind: str  # cosine | step | constant
    total: float
    warmup: float = 0.0
    warmup_method: str = "linear"
    warmup_decay: float = 0.01
    step_size: float = 30.0
    gamma: float = 0.1
    min_factor: float = 0.0
    per_epoch: bool = False

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES.values():
            raise ValueError(f"unknown schedule {self.kind!r}; choose {', '.join(SCHEDULES)}")
        if self.warmup_method not in ("linear", "constant"):
            raise ValueError(
                f"unknown --lr-warmup-method {self.warmup_method!r}; choose linear or constant"
            )

    def factor(self, progress: float) -> float:
        t = math.floor(progress) if self.per_epoch else progress
        if t < self.warmup:
            if self.warmup_method == "constant":
                return self.warmup_decay
            return self.warmup_decay + (1.0 - self.warmup_decay) * t / self.warmup
        if self.kind == "cosine":
            span = max(self.total - self.warmup, 1e-12)
            done = min((t - self.warmup) / span, 1.0)
            return self.min_factor + (1 - self.min_factor) * 0.5 * (1 + math.cos(math.pi * done))
        if self.kind == "step":
            return self.gamma ** math.floor((t - self.warmup) / max(self.step_size, 1e-12))
        return 1.0

    def apply(self, optimizer: torch.optim.Optimizer, progress: float) -> float:
        """Set every group's LR for ``progress``; returns the multiplier."""
        f = self.factor(progress)
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"] * f
        return f
