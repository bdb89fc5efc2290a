"""torchvision's ImageFolder reads a dataset inside a kernel-mounted image as it reads
the extracted tree: same classes, same samples, same pixels."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from stager.image.build import BuildOptions, Names, build_image
from tests import tar_corpus

torchvision = pytest.importorskip("torchvision")
Image = pytest.importorskip("PIL.Image")


def _jpegs(root: Path, classes: int = 3, per_class: int = 4) -> Path:
    rng = random.Random(0)
    for c in range(classes):
        folder = root / "train" / f"n{c:08d}"
        folder.mkdir(parents=True)
        for i in range(per_class):
            pixels = bytes(rng.randrange(256) for _ in range(16 * 16 * 3))
            Image.frombytes("RGB", (16, 16), pixels).save(folder / f"img_{i}.JPEG", quality=90)
    return root


def test_imagefolder_loads_the_same_samples_from_the_image(tmp_path: Path, kernel_mount) -> None:
    src = _jpegs(tmp_path / "src")
    archive = tmp_path / "train.tar.gz"
    tar_corpus.gnu_tar("-czf", archive, "-C", src, "train")
    image = tmp_path / "train.erofs"
    renames = (("train", "imagenet/train"),)
    build_image(str(archive), str(image), BuildOptions(names=Names(renames=renames)))
    mounted = kernel_mount(image)
    from_image = torchvision.datasets.ImageFolder(str(mounted / "imagenet" / "train"))
    from_tree = torchvision.datasets.ImageFolder(str(src / "train"))
    assert from_image.classes == from_tree.classes == [f"n{c:08d}" for c in range(3)]
    assert len(from_image) == len(from_tree) == 12
    for index in range(len(from_tree)):
        image_sample, image_label = from_image[index]
        tree_sample, tree_label = from_tree[index]
        assert image_label == tree_label
        assert image_sample.tobytes() == tree_sample.tobytes()
