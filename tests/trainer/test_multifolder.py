from __future__ import annotations

import csv

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms import v2

from tests.trainer.conftest import run_trainer, tiny_args
from trainer import checkpoint
from trainer.cli import get_args_parser
from trainer.multifolder import MultiFolderDataset, MultiViewFolder


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


def _views(root, per_class: int = 6) -> None:
    """root/{train,val}/{rgb,depth}/class<c>/<stem>: an RGB view and a greyscale one."""
    rng = np.random.default_rng(0)
    for split, n in (("train", per_class), ("val", 3)):
        for c in range(2):
            for i in range(n):
                rgb = np.clip(rng.normal(80 + 100 * c, 30, (20, 24, 3)), 0, 255).astype(np.uint8)
                _write(root / split / "rgb" / f"class{c}", f"{i:03d}.jpg", rgb)
                _write(root / split / "depth" / f"class{c}", f"{i:03d}.png", rgb[:, :, 1])


def test_multiview_folder_stacks_views_per_class(tmp_path):
    _views(tmp_path)
    ds = MultiViewFolder(tmp_path / "train", ["rgb", "depth"])
    assert ds.classes == ["class0", "class1"] and len(ds) == 12
    x, target = ds[7]
    assert x.shape == (6, 20, 24) and x.dtype == torch.uint8 and target == 1
    assert torch.equal(x[3], x[4])  # the greyscale view, decoded as RGB
    with pytest.raises(FileNotFoundError, match="check --views"):
        MultiViewFolder(tmp_path / "train", ["rgb", "normals"])


def test_multiview_classes_must_match(tmp_path):
    _views(tmp_path)
    (tmp_path / "train" / "depth" / "class1").rename(tmp_path / "train" / "depth" / "other")
    with pytest.raises(ValueError, match="same class folders"):
        MultiViewFolder(tmp_path / "train", ["rgb", "depth"])


@pytest.mark.slow
def test_trainer_cli_trains_on_multifolder(tmp_path):
    _views(tmp_path / "data")
    out = tmp_path / "out"
    args = tiny_args(out, "--iterations", "2", "--data-root", str(tmp_path / "data"),
                     "--views", "rgb,depth", "--num-classes", "2")  # fmt: skip
    args[args.index("fake")] = "multifolder"
    done = run_trainer(args)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "data: multifolder train=12 val=6 classes=2" in done.stderr
    with open(out / "epochs.csv") as f:
        row = list(csv.DictReader(f))[-1]
    assert row["iteration"] == "2" and row["count"] == "6"
    model = checkpoint.load(checkpoint.latest(out / "checkpoints"))["model"]
    assert model["features.0.weight"].shape[1] == 6  # 3 channels per view


def test_multifolder_flags_are_documented():
    text = get_args_parser().format_help()
    assert "multifolder" in text and "--views" in text and "--align" in text
