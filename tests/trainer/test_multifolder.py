from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms import v2

from trainer.multifolder import MultiFolderDataset


def _write(folder, name, arr):
    folder.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr).save(folder / name)


def test_aligned_views_stay_aligned_under_random_crops(tmp_path):
    rng = np.random.default_rng(0)
    for i in range(4):
        rgb = rng.integers(0, 256, (20, 24, 3), dtype=np.uint8)
        _write(tmp_path / "rgb", f"{i:04d}_a.png", rgb)
        _write(tmp_path / "inv", f"{i:04d}_a.png", 255 - rgb)  # same stem, other folder
        _write(tmp_path / "mask", f"{i:04d}_a.png", rgb[:, :, 0])
    joint = v2.Compose([v2.RandomResizedCrop(12, antialias=False,
                                             interpolation=v2.InterpolationMode.NEAREST),
                        v2.RandomHorizontalFlip()])  # fmt: skip
    ds = MultiFolderDataset([tmp_path / "rgb", tmp_path / "inv", tmp_path / "mask"], joint)
    assert len(ds) == 4
    for i in range(4):
        torch.manual_seed(i)
        rgb, inv, mask = ds[i]
        assert rgb.shape == (3, 12, 12) and mask.shape == (1, 12, 12)
        assert torch.equal(rgb, 255 - inv) and torch.equal(rgb[:1], mask)


def test_missing_file_is_named(tmp_path):
    arr = np.zeros((4, 4, 3), dtype=np.uint8)
    for name in ("a.png", "b.png"):
        _write(tmp_path / "x", name, arr)
    _write(tmp_path / "y", "a.png", arr)
    with pytest.raises(ValueError, match=r"lacks 1 image.*'b'"):
        MultiFolderDataset([tmp_path / "x", tmp_path / "y"])
    with pytest.raises(ValueError, match="different numbers"):
        MultiFolderDataset([tmp_path / "x", tmp_path / "y"], align="order")
