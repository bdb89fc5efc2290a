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


def build_model(arch: str, num_classes: int, in_channels: int = 3) -> nn.Module:
    if arch in LOCAL_MODELS:
        model = LOCAL_MODELS[arch](num_classes=num_classes)
    else:
        try:
            model = torchvision.models.get_model(arch, weights=None, num_classes=num_classes)
        except ValueError as exc:
            raise ValueError(
                f"unknown --arch {arch!r}; use a torchvision classification model such as "
                "resnet50, or tinynet for smoke tests"
            ) from exc
    if in_channels != 3:
        _set_in_channels(model, arch, in_channels)
    return model


def _set_in_channels(model: nn.Module, arch: str, in_channels: int) -> None:
    """Replace the first convolution so the model takes stacked views (multifolder)."""
    for name, conv in model.named_modules():
        if isinstance(conv, nn.Conv2d):
            parent, _, attr = name.rpartition(".")
            new = nn.Conv2d(
                in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding,
                conv.dilation, conv.groups, conv.bias is not None, conv.padding_mode,
            )  # fmt: skip
            setattr(model.get_submodule(parent), attr, new)
            return
    raise ValueError(f"--arch {arch} has no Conv2d input layer to take {in_channels} channels")
