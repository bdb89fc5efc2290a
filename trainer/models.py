"""Model by name: any torchvision classification model, plus a tiny CPU test net."""

from __future__ import annotations

import torchvision
from torch import nn


class TinyNet(nn.Module):
    """A few thousand parameters, no BatchNorm or dropout.

    For smoke runs and tests on CPU: without batch statistics, k micro-batches
    and one k-times larger batch give the same gradients, so accumulation can
    be checked exactly.
    """

    def __init__(self, num_classes: int = 10, width: int = 16) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3, stride=2, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, width * 2, 3, stride=2, padding=1),
            nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.fc = nn.Linear(width * 2, num_classes)

    def forward(self, x):
        return self.fc(self.features(x))


LOCAL_MODELS = {"tinynet": TinyNet}


def available() -> list[str]:
    return sorted(LOCAL_MODELS) + sorted(torchvision.models.list_models(torchvision.models))


def build_model(arch: str, num_classes: int) -> nn.Module:
    if arch in LOCAL_MODELS:
        return LOCAL_MODELS[arch](num_classes=num_classes)
    try:
        return torchvision.models.get_model(arch, weights=None, num_classes=num_classes)
    except ValueError as exc:
        raise ValueError(
            f"unknown --arch {arch!r}; use a torchvision classification model such as "
            "resnet50, or tinynet for smoke tests"
        ) from exc
