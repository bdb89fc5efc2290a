"""The ``imagenet_val`` op: sort the flat val images into ``val/<wnid>/`` by the devkit.

The devkit's ground truth gives one label per image in file-name order (as
torchvision's ``parse_val_archive`` pairs them); a count that does not match fails
instead of mislabelling the tail. Restartable: images an interrupted run moved are
found in their class folders.
"""

from __future__ import annotations

import os

from stager.archive.devkit import check_devkit, read_devkit
from stager.core.errors import BadRequest, StagingError, from_os_error
from stager.ops.base import (
    AbsoluteSource,
    CheckContext,
    OpContext,
    RelativePath,
    StepParams,
    make_dir,
)


class ImagenetValStep(StepParams):
    """Sort the flat ImageNet val images in ``dst`` into ``dst/<wnid>/`` by the devkit."""

    src: AbsoluteSource  # the devkit archive
    dst: RelativePath = "val"


def check(step: ImagenetValStep, ctx: CheckContext) -> int:
    return check_devkit(step.src, needs_torch=False)


def run(step: ImagenetValStep, ctx: OpContext) -> None:
    wnids = read_devkit(step.src, ctx.allowed_roots).val_wnids
    folder = ctx.destination(step.dst)
    if not folder.is_dir():
        raise BadRequest(
            f"imagenet_val: {step.dst!r} is not a folder of the dataset; an earlier step must "
            "extract ILSVRC2012_img_val.tar into it"
        )
    try:
        images = _images(str(folder))
        if len(images) != len(wnids):
            raise StagingError(
                f"{step.dst!r} holds {len(images)} images but the devkit {step.src} labels "
                f"{len(wnids)}; use the ILSVRC2012_img_val.tar that matches the devkit"
            )
        ctx.progress.add_total(0, len(images))
        for wnid in sorted(set(wnids)):
            make_dir(os.path.join(folder, wnid))
        for (name, current), wnid in zip(images, wnids, strict=True):
            ctx.check_cancelled()
            target = os.path.join(folder, wnid, name)
            if current != target:
                os.rename(current, target)
            ctx.progress.advance(0, 1)
    except OSError as exc:
        raise from_os_error(exc, f"sorting {step.dst!r} into class folders") from exc


def _images(folder: str) -> list[tuple[str, str]]:
    """(file name, current path) of every image, flat or already sorted, by name."""
    found: list[tuple[str, str]] = []
    with os.scandir(folder) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                with os.scandir(entry.path) as inner:
                    found.extend((e.name, e.path) for e in inner if e.is_file())
            elif entry.is_file():
                found.append((entry.name, entry.path))
    found.sort()
    return found
