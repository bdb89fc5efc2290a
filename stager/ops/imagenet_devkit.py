"""The ``imagenet_devkit`` op: write torchvision's ImageNet ``meta.bin`` from the devkit.

The same tuple ``torchvision.datasets.imagenet.parse_devkit_archive`` saves, so
``ImageNet(root, split=...)`` finds it and never opens the devkit archive itself.
Written to a temporary name and renamed: a half-written ``meta.bin`` would pass
torchvision's only check (that the file exists).
"""

from __future__ import annotations

import os

from stager.archive.devkit import check_devkit, import_torch, read_devkit
from stager.core.errors import from_os_error
from stager.ops.base import AbsoluteSource, CheckContext, OpContext, RelativePath, StepParams


class ImagenetDevkitStep(StepParams):
    """Write torchvision's ImageNet ``meta.bin`` from ``ILSVRC2012_devkit_t12.tar.gz``."""

    src: AbsoluteSource  # the devkit archive
    dst: RelativePath = "meta.bin"


def check(step: ImagenetDevkitStep, ctx: CheckContext) -> int:
    return check_devkit(step.src, needs_torch=True)


def run(step: ImagenetDevkitStep, ctx: OpContext) -> None:
    ctx.check_cancelled()
    devkit = read_devkit(step.src, ctx.allowed_roots)
    torch = import_torch()
    target = ctx.destination(step.dst)
    partial = target.with_name(target.name + ".part")
    ctx.progress.add_total(0, 1)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        torch.save((devkit.wnid_to_classes, devkit.val_wnids), partial)
        os.replace(partial, target)
    except OSError as exc:
        raise from_os_error(exc, f"writing {step.dst}") from exc
    ctx.progress.advance(0, 1)
