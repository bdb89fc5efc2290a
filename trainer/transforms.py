"""Per-sample transforms (torchvision references' presets) and the on-device normalisation.

Two input paths produce the same batches in different places:

- ``pil``: what torchvision's reference does: PIL decode, PIL resize, float
  conversion and normalisation in the worker; float32 batches cross the
  worker->main queue (4 bytes a pixel).
- ``fast`` (default): libjpeg-turbo decode straight into a uint8 tensor, the
  same v2 transforms on uint8 tensors, uint8 batches (1 byte a pixel) to the
  device, and the float conversion and normalisation there (`DeviceNormalize`).

The training preset is the reference's ``ClassificationPresetTrain``:
RandomResizedCrop, horizontal flip, then optionally an automatic augmentation
policy (``--auto-augment ra|ta_wide|augmix|imagenet``) and random erasing
(``--random-erase P``). The reference erases after normalisation with 0, i.e.
with the mean colour; on uint8 the same mean colour is written before
normalisation, which gives the same pixels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torchvision.transforms import v2

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
AUTO_AUGMENT = ("ra", "ta_wide", "augmix", "imagenet", "cifar10", "svhn")
# The mean colour as uint8: what a normalised 0 is before normalisation.
_MEAN_U8 = [round(255 * m) for m in IMAGENET_MEAN]


@dataclass(frozen=True)
class Augment:
    """The training augmentation flags (torchvision references' names)."""

    crop: int = 224
    flip: bool = True
    auto_augment: str | None = None  # one of AUTO_AUGMENT
    ra_magnitude: int = 9
    augmix_severity: int = 3
    random_erase: float = 0.0
    enabled: bool = True  # False: the deterministic eval view (overfitting checks)


def to_uint8_tensor(img: Any) -> torch.Tensor:
    """Datasets that yield PIL images (FakeData, CIFAR) enter the fast path here."""
    if isinstance(img, torch.Tensor):
        return img
    return v2.functional.pil_to_tensor(img.convert("RGB"))


def auto_augment(policy: str, ra_magnitude: int = 9, augmix_severity: int = 3) -> Callable:
    interpolation = v2.InterpolationMode.BILINEAR
    if policy == "ra":
        return v2.RandAugment(interpolation=interpolation, magnitude=ra_magnitude)
    if policy == "ta_wide":
        return v2.TrivialAugmentWide(interpolation=interpolation)
    if policy == "augmix":
        return v2.AugMix(interpolation=interpolation, severity=augmix_severity)
    if policy in ("imagenet", "cifar10", "svhn"):
        return v2.AutoAugment(v2.AutoAugmentPolicy(policy), interpolation=interpolation)
    raise ValueError(f"unknown --auto-augment {policy!r}; choose one of {', '.join(AUTO_AUGMENT)}")


def train_transform(pipeline: str, aug: Augment, val_resize: int = 256) -> Callable:
    if not aug.enabled:
        # Overfitting checks and smoke runs: the deterministic eval view.
        return eval_transform(pipeline, val_resize, aug.crop)
    steps: list[Callable] = [] if pipeline == "pil" else [to_uint8_tensor]
    steps.append(v2.RandomResizedCrop(aug.crop, antialias=True))
    if aug.flip:
        steps.append(v2.RandomHorizontalFlip())
    if aug.auto_augment:
        steps.append(auto_augment(aug.auto_augment, aug.ra_magnitude, aug.augmix_severity))
    if pipeline == "pil":
        steps += _pil_to_normalised()
        if aug.random_erase > 0:
            steps.append(v2.RandomErasing(p=aug.random_erase, value=0))
    elif aug.random_erase > 0:
        steps.append(v2.RandomErasing(p=aug.random_erase, value=_MEAN_U8))
    return v2.Compose(steps)


def eval_transform(pipeline: str, resize: int, crop: int) -> Callable:
    steps: list[Callable] = [v2.Resize(resize, antialias=True), v2.CenterCrop(crop)]
    if pipeline == "pil":
        return v2.Compose([*steps, *_pil_to_normalised()])
    return v2.Compose([to_uint8_tensor, *steps])


def _pil_to_normalised() -> list[Callable]:
    return [
        v2.PILToTensor(),
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(IMAGENET_MEAN, IMAGENET_STD),
    ]


class DeviceNormalize:
    """uint8 NCHW batch on the device -> normalised float (no-op on float input).

    On CPU the float output goes into one of two reused buffers: a fresh 38 MB
    tensor per batch costs more in page faults than the arithmetic itself
    (glibc hands large blocks back to the OS on free). A result therefore
    stays valid until the call after next, which is all a training or
    evaluation step needs. CUDA's caching allocator makes fresh tensors cheap,
    so there each call allocates.
    """

    def __init__(
        self, device: torch.device, channels_last: bool = False, channels: int = 3
    ) -> None:
        # Stacked RGB views (--dataset multifolder) get the RGB statistics per view.
        views = channels // 3
        mean = torch.tensor(IMAGENET_MEAN, device=device).repeat(views).view(1, channels, 1, 1)
        std = torch.tensor(IMAGENET_STD, device=device).repeat(views).view(1, channels, 1, 1)
        self.mean = mean * 255
        self.inv_std = 1.0 / (std * 255)
        self.device = device
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self._ring: list[torch.Tensor] = []
        self._turn = 0

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        images = images.to(self.device, non_blocking=True)
        if images.dtype == torch.uint8:
            out = self._buffer(images)
            out.copy_(images)
            images = out.sub_(self.mean).mul_(self.inv_std)
        return images.contiguous(memory_format=self.memory_format)

    def _buffer(self, like: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cpu":
            return torch.empty(like.shape, device=self.device, memory_format=self.memory_format)
        if not self._ring or self._ring[0].shape != like.shape:
            self._ring = [
                torch.empty(like.shape, memory_format=self.memory_format) for _ in range(2)
            ]
        self._turn ^= 1
        return self._ring[self._turn]
