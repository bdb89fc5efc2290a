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
