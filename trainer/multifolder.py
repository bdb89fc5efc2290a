"""Samples made of several aligned images, one folder per image (seeds/003's MultiImgsDataset).

``dirs = [inputs_rgb, inputs_depth, masks]``: sample i is the i-th file of
each folder. Two ways to align:

- ``"stem"`` (default): files are matched by name without extension, and a
  name missing from any folder is an error that names it; seeds/003 relied on
  sorting alone, which silently misaligns as soon as one file is missing.
- ``"order"``: the i-th file of each sorted folder (seeds/003's behaviour, for
  folders whose names differ), with equal counts required.

``transform`` is applied to all images of a sample *together* (torchvision v2
draws one random crop/flip for all of them), so they stay aligned;
``transforms`` are optional per-folder transforms applied afterwards (e.g. a
different normalisation per input).

`MultiViewFolder` is what ``stager-train --dataset multifolder`` trains on:
classification where each sample is several aligned views of one object.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch.utils.data import Dataset
from torchvision import tv_tensors
from torchvision.io import ImageReadMode, decode_image, read_file

IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")


def _load(path: str) -> tv_tensors.Image:
    # UNCHANGED keeps greyscale masks single-channel.
    return tv_tensors.Image(decode_image(read_file(path), mode=ImageReadMode.UNCHANGED))


def _load_rgb(path: str) -> torch.Tensor:
    # Three channels for every view, so the input width is 3 x views whatever
    # the files hold (a greyscale depth map is repeated).
    return decode_image(read_file(path), mode=ImageReadMode.RGB)


class MultiFolderDataset(Dataset):
    def __init__(
        self,
        dirs: Sequence[str | os.PathLike],
        transform: Callable | None = None,
        transforms: Sequence[Callable | None] | None = None,
        align: str = "stem",
        loader: Callable[[str], torch.Tensor] = _load,
    ) -> None:
        if not dirs:
            raise ValueError("MultiFolderDataset needs at least one folder")
        if transforms is not None and len(transforms) != len(dirs):
            raise ValueError(f"{len(transforms)} transforms for {len(dirs)} folders")
        self.dirs = [Path(d) for d in dirs]
        self.transform = transform
        self.transforms = transforms
        self.loader = loader
        listings = [self._list(d) for d in self.dirs]
        if align == "stem":
            self.files = self._by_stem(listings)
        elif align == "order":
            counts = {len(files) for files in listings}
            if len(counts) != 1:
                raise ValueError(f"folders hold different numbers of images: {counts}")
            self.files = [tuple(row) for row in zip(*listings, strict=True)]
        else:
            raise ValueError(f"align must be 'stem' or 'order', not {align!r}")

    @staticmethod
    def _list(folder: Path) -> list[str]:
        if not folder.is_dir():
            raise FileNotFoundError(f"image folder {folder} does not exist")
        names = sorted(n for n in os.listdir(folder) if n.lower().endswith(IMAGE_EXTS))
        return [str(folder / n) for n in names]

    def _by_stem(self, listings: list[list[str]]) -> list[tuple[str, ...]]:
        maps = [{Path(p).stem: p for p in files} for files in listings]
        stems = sorted(set().union(*maps))
        for folder, m in zip(self.dirs, maps, strict=True):
            missing = [s for s in stems if s not in m]
            if missing:
                raise ValueError(
                    f"{folder} lacks {len(missing)} image(s) the other folders have, "
                    f"e.g. {missing[:3]}; add them or use align='order'"
                )
        return [tuple(m[s] for m in maps) for s in stems]

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        images = tuple(self.loader(p) for p in self.files[index])
        if self.transform is not None:
            images = tuple(self.transform(images))
        if self.transforms is not None:
            images = tuple(
                t(img) if t is not None else img
                for t, img in zip(self.transforms, images, strict=True)
            )
        return images


class MultiViewFolder(Dataset):
    """Classification on aligned views: ``root/<view>/<class>/<name>`` for each view.

    Each view folder is an ImageFolder tree with the same classes; a sample is
    one name (aligned as in `MultiFolderDataset`) in every view, decoded as
    RGB and stacked along channels, so the model sees ``3 * len(views)``
    channels. ``transform`` gets the stacked uint8 tensor: one random crop or
    flip then moves all views together.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        views: Sequence[str],
        transform: Callable | None = None,
        align: str = "stem",
    ) -> None:
        if not views:
            raise ValueError("--dataset multifolder needs --views, e.g. --views rgb,depth")
        root = Path(root)
        self.classes = _class_names(root, views)
        self.transform = transform
        # One aligned dataset per class: a name must sit in the same class in every view.
        self.parts = [
            MultiFolderDataset([root / v / c for v in views], align=align, loader=_load_rgb)
            for c in self.classes
        ]
        self.items = [(c, i) for c, part in enumerate(self.parts) for i in range(len(part))]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        target, i = self.items[index]
        views = self.parts[target][i]
        if len({v.shape[1:] for v in views}) != 1:
            raise ValueError(
                f"views of {self.parts[target].files[i][0]} differ in size "
                f"({[tuple(v.shape[1:]) for v in views]}); aligned views must match"
            )
        stacked = torch.cat(views)
        return (self.transform(stacked) if self.transform else stacked), target


def _class_names(root: Path, views: Sequence[str]) -> list[str]:
    found = []
    for view in views:
        folder = root / view
        if not folder.is_dir():
            raise FileNotFoundError(f"view folder {folder} does not exist; check --views")
        found.append(sorted(d.name for d in folder.iterdir() if d.is_dir()))
    if not found[0]:
        raise FileNotFoundError(f"no class folders in {root / views[0]}; expected <view>/<class>/")
    for view, names in zip(views[1:], found[1:], strict=True):
        if names != found[0]:
            raise ValueError(
                f"view {view!r} has classes {names}, view {views[0]!r} has {found[0]}; "
                "every view needs the same class folders"
            )
    return found[0]
