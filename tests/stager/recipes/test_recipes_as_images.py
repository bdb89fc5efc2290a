"""The ImageNet and iNaturalist recipes staged as images (docs/image-mode.md): fake
release files in their exact formats, staged by a real daemon into one mounted
image each, loaded by real torchvision with ``download=False``, every sample read
and checked against what was generated; and which of their steps stream into the
image rather than write a tree (``stager.kinds.imaging.plan``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from stager.core.settings import Settings
from stager.image import mount as image_mount
from stager.kinds import imaging
from stager.ops import table
from stager.request import recipes
from stager.wire.schemas import DatasetCreate, DatasetPublic
from tests.daemon import Daemon
from tests.stager.recipes import fakes
from tests.stager.recipes.test_recipes_load import construct, load_all, only_usage

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="kernel mounts need root")


def stage_image(
    daemon: Daemon, name: str, recipe: str, source: Path, **params: Any
) -> DatasetPublic:
    body = {"name": name, "recipe": recipe, "source": str(source), "params": params, "image": True}
    with daemon.client() as client:
        response = client.post("/v1/datasets", json=body)
        assert response.status_code in (200, 202), response.text
        waited = client.get(f"/v1/datasets/{name}/wait", params={"timeout": 60})
    status = DatasetPublic.model_validate_json(waited.text)
    assert status.state == "ready", (status.error, daemon.log())
    assert status.image is not None and image_mount.mounted_at(status.path) is not None
    return status


def test_imagenet_as_an_image_loads_in_torchvision(recipe_daemon: Daemon, tmp_path: Path) -> None:
    source = tmp_path / "imagenet"
    expected = fakes.make_imagenet(source, classes=4, train_per_class=3, val_per_class=2)
    status = stage_image(recipe_daemon, "imagenet-image", "imagenet", source)
    assert sorted(os.listdir(status.path)) == ["meta.bin", "train", "val"]
    for usage in status.usage:
        split = usage.kwargs["split"]
        dataset = construct(usage, status.path)
        exp = expected[split]
        targets = load_all(dataset)
        assert len(targets) == len(exp.files)
        assert dataset.wnids == sorted(exp.classes)
        for (path, target), loaded in zip(dataset.samples, targets, strict=True):
            assert loaded == target and dataset.wnids[target] == exp.files[os.path.basename(path)]


def test_inat2021_as_an_image_loads_in_torchvision(recipe_daemon: Daemon, tmp_path: Path) -> None:
    source = tmp_path / "inat"
    expected = fakes.make_inat2021(source, fakes.INAT2021_TOPS)
    status = stage_image(recipe_daemon, "inat-image", "inat2021", source, splits=["2021_valid"])
    assert sorted(os.listdir(status.path)) == ["2021_valid"]  # the top folder renamed
    dataset = construct(only_usage(status), status.path)
    exp = expected["2021_valid"]
    targets = load_all(dataset)
    assert len(targets) == len(exp.files)
    for (_, fname), target in zip(dataset.index, targets, strict=True):
        assert dataset.all_categories[target] == exp.files[fname]


def steps_of(recipe: str, source: Path, **params: Any) -> list[Any]:
    request = DatasetCreate(name="x", recipe=recipe, source=str(source), params=params)
    expansion = recipes.expand(request, Settings())
    return table.load().expand(expansion.steps)


def test_the_big_archives_stream_and_only_what_needs_a_tree_writes_one(tmp_path: Path) -> None:
    """ImageNet: the devkit's meta.bin is written (an op), the train tar of class tars
    streams into the image in place, the val tar is extracted because the val sort reads
    it; iNaturalist: the archive streams and its rename moves names."""
    fakes.make_imagenet(tmp_path / "imagenet", classes=2, train_per_class=1, val_per_class=1)
    imagenet = imaging.plan(
        table.load(), steps_of("imagenet", tmp_path / "imagenet"), lambda s: "tar"
    )
    assert imagenet.kinds == ["tree", "stream", "tree", "tree"]
    assert imagenet.streams[2].nested and imagenet.streams[2].dst == "train"
    fakes.make_inat2021(tmp_path / "inat", fakes.INAT2021_TOPS)
    inat = imaging.plan(
        table.load(), steps_of("inat2021", tmp_path / "inat", splits=["2021_valid"]), lambda s: "gz"
    )
    assert inat.kinds == ["stream", "name"]
    assert inat.names_after(1) == (("val", "2021_valid"),)


def test_a_rename_before_an_op_and_a_zip_are_made_as_a_tree() -> None:
    ops = table.load()
    steps = ops.validate_steps(
        [
            {"op": "extract", "src": "/data/a.tar"},
            {"op": "rename", "src": "a", "dst": "b"},
            {"op": "copy", "src": "/data/c", "dst": "c"},
            {"op": "extract", "src": "/data/z.zip", "dst": "z"},
        ]
    )
    planned = imaging.plan(ops, steps, lambda src: "zip" if src.endswith(".zip") else "tar")
    # The copy runs after the rename, so the rename must move real files: a tree; and
    # the archive the rename moves must then be in that tree too.
    assert planned.kinds == ["tree", "tree", "tree", "tree"]
