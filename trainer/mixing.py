"""Mixup and CutMix on a normalised batch (torchvision references' --mixup-alpha / --cutmix-alpha).

The reference mixes in its collate function, on float batches. The fast
pipeline's batches are uint8 until they reach the device, so mixing happens
there, after `trainer.transforms.DeviceNormalize`: normalisation is
per-pixel affine, so mixing normalised images gives exactly the normalised
mix of the raw ones, and pasting a CutMix box commutes with it too. Draws come
from the rank's per-step seed (`trainer.seeding.seed_step`), so each rank
mixes differently and a resumed run mixes as the uninterrupted one did.
"""

from __future__ import annotations

import torch
from torchvision.transforms import v2


class BatchMix:
    """One of mixup / cutmix per batch, with equal probability when both are on.

    Returns the mixed images and soft targets (N x classes probabilities),
    which ``CrossEntropyLoss`` takes as they are (label smoothing included).
    """

    def __init__(self, num_classes: int, mixup_alpha: float = 0.0, cutmix_alpha: float = 0.0):
        choices: list[v2.Transform] = []
        if mixup_alpha > 0:
            choices.append(v2.MixUp(alpha=mixup_alpha, num_classes=num_classes))
        if cutmix_alpha > 0:
            choices.append(v2.CutMix(alpha=cutmix_alpha, num_classes=num_classes))
        if not choices:
            raise ValueError("BatchMix needs --mixup-alpha or --cutmix-alpha above 0")
        self.transform = choices[0] if len(choices) == 1 else v2.RandomChoice(choices)

    def __call__(
        self, images: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.transform(images, targets)


def make(num_classes: int, mixup_alpha: float = 0.0, cutmix_alpha: float = 0.0) -> BatchMix | None:
    """The batch mixer the flags ask for, or None."""
    if mixup_alpha <= 0 and cutmix_alpha <= 0:
        return None
    return BatchMix(num_classes, mixup_alpha, cutmix_alpha)
