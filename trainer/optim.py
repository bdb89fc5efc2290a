"""Optimizers, per-parameter learning rates (seeds/003's make_param_groups) and schedules."""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping

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


def make_param_groups(
    model: nn.Module,
    lr: float,
    weight_decay: float,
    lr_overrides: Mapping[str, float] | None = None,
    decay_norm_and_bias: bool = False,
) -> list[dict]:
    """Group parameters by (lr, weight decay).

    ``lr_overrides`` maps a parameter name or glob ("layer4.*") to its own LR;
    the first matching pattern wins. Norm weights and biases (every parameter
    with fewer than 2 dimensions) get no weight decay unless asked: decaying
    them only pulls the normalisation scale towards zero.
    """
    lr_overrides = dict(lr_overrides or {})
    used: set[str] = set()
    groups: dict[tuple[float, float], dict] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        p_lr = lr
        for pattern, value in lr_overrides.items():
            if name == pattern or fnmatch.fnmatchcase(name, pattern):
                p_lr = value
                used.add(pattern)
                break
        wd = weight_decay if (param.ndim > 1 or decay_norm_and_bias) else 0.0
        group = groups.setdefault((p_lr, wd), {"params": [], "lr": p_lr, "weight_decay": wd})
        group["params"].append(param)
    unused = sorted(set(lr_overrides) - used)
    if unused:
        raise ValueError(
            f"--lr-override {', '.join(unused)} matches no parameter; "
            f"names look like {next(iter(dict(model.named_parameters())), '?')!r}"
        )
    return list(groups.values())


def build_optimizer(
    name: str, groups: list[dict], lr: float, momentum: float, weight_decay: float
) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}; choose sgd or adamw")


def lr_factor(
    step: int,
    total: int,
    warmup: int,
    warmup_start: float,
    kind: str,
    step_size: int,
    gamma: float,
    min_factor: float,
) -> float:
    """Multiplier of the base LR after ``step`` scheduler steps (iterations or epochs)."""
    if step < warmup:
        return warmup_start + (1.0 - warmup_start) * step / warmup
    if kind == "cosine":
        span = max(total - warmup, 1)
        progress = min((step - warmup) / span, 1.0)
        return min_factor + (1 - min_factor) * 0.5 * (1 + math.cos(math.pi * progress))
    if kind == "step":
        return gamma ** ((step - warmup) // max(step_size, 1))
    if kind == "constant":
        return 1.0
    raise ValueError(f"unknown schedule {kind!r}; choose cosine, step or constant")


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    kind: str,
    total: int,
    warmup: int,
    warmup_start: float = 0.01,
    step_size: int = 30,
    gamma: float = 0.1,
    min_factor: float = 0.0,
) -> torch.optim.lr_scheduler.LambdaLR:
    # LambdaLR scales each group's own initial LR, so per-parameter overrides survive.
    def factor(step: int) -> float:
        return lr_factor(step, total, warmup, warmup_start, kind, step_size, gamma, min_factor)

    lr_factor(0, total, warmup, warmup_start, kind, step_size, gamma, min_factor)  # validate kind
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
