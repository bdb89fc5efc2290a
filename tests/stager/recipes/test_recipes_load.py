"""Each recipe and split, end to end: fake release files in their exact formats,
staged by a real daemon, loaded by real torchvision with ``download=False``,
every sample read and checked against what was generated."""

from __future__ import annotations

import importlib
import inspect
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stager.wire.schemas import DatasetPublic, TorchvisionUsage
from tests.daemon import Daemon
from tests.stager.recipes import fakes


def stage_recipe(
    daemon: Daemon, name: str, recipe: str, source: Path, **params: Any
) -> DatasetPublic:
    body = {"name": name, "recipe": recipe, "source": str(source), "params": params}
    with daemon.client() as client:
        response = client.post("/v1/datasets", json=body)
        assert response.status_code in (200, 202), response.text
        waited = client.get(f"/v1/datasets/{name}/wait", params={"timeout": 60})
    status = DatasetPublic.model_validate_json(waited.text)
    assert status.state == "ready", (status.error, daemon.log())
    return status


def construct(usage: TorchvisionUsage, path: str, cls: type | None = None) -> Any:
    """Build the dataset the way the status's ``code`` line says, with download=False."""
    module, _, name = usage.class_.rpartition(".")
    cls = cls or getattr(importlib.import_module(module), name)
    root = os.path.join(path, usage.root) if usage.root not in ("", ".") else path
    kwargs = dict(usage.kwargs)
    if "download" in inspect.signature(cls.__init__).parameters:
        kwargs["download"] = False
    return cls(root=root, **kwargs)


def only_usage(status: DatasetPublic) -> TorchvisionUsage:
    assert len(status.usage) == 1, status.usage
    usage = status.usage[0]
    root = os.path.join(status.path, usage.root) if usage.root != "." else status.path
    args = "".join(f", {k}={v!r}" for k, v in usage.kwargs.items())
    assert usage.code == f"{usage.class_}(root={root!r}{args})"
    return usage


def load_all(dataset: Any) -> list[Any]:
    """Read and decode every sample; return the targets."""
    targets = []
    for i in range(len(dataset)):
        image, target = dataset[i]
        if hasattr(image, "load"):
            image.load()  # INaturalist returns a lazily decoded PIL image
        assert image.size[0] > 0
        targets.append(target)
    return targets


@pytest.fixture(scope="module")
def inat2021_source(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    source = tmp_path_factory.mktemp("inat2021")
    return source, fakes.make_inat2021(source, fakes.INAT2021_TOPS)


@pytest.mark.parametrize("split", ["2021_train", "2021_train_mini", "2021_valid"])
def test_inat2021_split_loads_in_torchvision(
    recipe_daemon: Daemon, inat2021_source: tuple[Path, dict], split: str
) -> None:
    source, expected = inat2021_source
    status = stage_recipe(
        recipe_daemon, f"inat-{split.replace('_', '-')}", "inat2021", source, splits=[split]
    )
    assert sorted(os.listdir(status.path)) == [split]  # narrowed to one split
    usage = only_usage(status)
    assert usage.kwargs == {"version": split}
    dataset = construct(usage, status.path)
    exp = expected[split]
    assert dataset.all_categories == sorted(exp.classes)
    targets = load_all(dataset)
    assert len(targets) == len(exp.files)
    for (_, fname), target in zip(dataset.index, targets, strict=True):
        assert dataset.all_categories[target] == exp.files[fname]


@pytest.mark.parametrize("year", ["2017", "2018", "2019"])
def test_inat_pre2021_release_loads_in_torchvision(
    recipe_daemon: Daemon, tmp_path: Path, year: str
) -> None:
    exp = fakes.make_inat_pre2021(tmp_path / "src", year)
    status = stage_recipe(recipe_daemon, f"inat{year}", f"inat{year}", tmp_path / "src")
    assert sorted(os.listdir(status.path)) == [year]
    dataset = construct(only_usage(status), status.path)
    targets = load_all(dataset)
    assert len(targets) == len(exp.files)
    assert sorted(dataset.all_categories) == sorted(exp.classes)
    for (_, fname), target in zip(dataset.index, targets, strict=True):
        assert dataset.all_categories[target] == exp.files[fname]


@pytest.fixture(scope="module")
def imagenet_source(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    source = tmp_path_factory.mktemp("imagenet")
    return source, fakes.make_imagenet(source, classes=4, train_per_class=3, val_per_class=2)


@pytest.mark.parametrize("split", ["train", "val"])
def test_imagenet_split_loads_without_reparsing(
    recipe_daemon: Daemon, imagenet_source: tuple[Path, dict], split: str
) -> None:
    source, expected = imagenet_source
    status = stage_recipe(recipe_daemon, f"imagenet-{split}", "imagenet", source, splits=[split])
    # meta.bin and the split folder only: torchvision must not find an archive to parse.
    assert sorted(os.listdir(status.path)) == ["meta.bin", split]
    dataset = construct(only_usage(status), status.path)
    exp = expected[split]
    targets = load_all(dataset)
    assert len(targets) == len(exp.files)
    assert dataset.wnids == sorted(exp.classes)
    for (path, target), loaded in zip(dataset.samples, targets, strict=True):
        wnid = exp.files[os.path.basename(path)]
        assert loaded == target and dataset.wnids[target] == wnid
        assert dataset.classes[target] == exp.classes[wnid]


def test_imagenet_meta_bin_equals_what_torchvision_writes_from_the_same_devkit(
    recipe_daemon: Daemon, imagenet_source: tuple[Path, dict], tmp_path: Path, monkeypatch
) -> None:
    import torch
    import torchvision.datasets.imagenet as tv_imagenet

    source, _ = imagenet_source
    status = stage_recipe(recipe_daemon, "imagenet-both", "imagenet", source)
    assert sorted(os.listdir(status.path)) == ["meta.bin", "train", "val"]
    theirs = tmp_path / "tv"
    theirs.mkdir()
    (theirs / fakes.IMAGENET_DEVKIT).symlink_to(source / fakes.IMAGENET_DEVKIT)
    # The fake devkit cannot match the release's md5; everything else is torchvision's own.
    monkeypatch.setattr(tv_imagenet, "_verify_archive", lambda *args: None)
    tv_imagenet.parse_devkit_archive(str(theirs))
    ours = torch.load(Path(status.path) / "meta.bin", weights_only=True)
    assert ours == torch.load(theirs / "meta.bin", weights_only=True)


@pytest.fixture(scope="module")
def cifar_sources(tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[Path, Any]]:
    out = {}
    for which in (10, 100):
        source = tmp_path_factory.mktemp(f"cifar{which}")
        out[which] = (source, fakes.make_cifar(source, which))
    return out


def cifar_class_for_fakes(base: type, which: int, exp: fakes.CifarExpected) -> type:
    """torchvision checks every CIFAR file against the release md5s; the layout is what
    is under test, so a subclass swaps in the fakes' md5s and changes nothing else."""
    layout = fakes.CIFAR_LAYOUT[which]
    meta_name, meta_key = layout["meta"]
    return type(
        f"Fake{base.__name__}",
        (base,),
        {
            "train_list": [[n, exp.md5[n]] for n in layout["train"]],
            "test_list": [[n, exp.md5[n]] for n in layout["test"]],
            "meta": {"filename": meta_name, "key": meta_key, "md5": exp.md5[meta_name]},
        },
    )


@pytest.mark.parametrize("which", [10, 100])
@pytest.mark.parametrize("split", ["train", "test"])
def test_cifar_split_loads_in_torchvision(
    recipe_daemon: Daemon, cifar_sources: dict, which: int, split: str
) -> None:
    source, exp = cifar_sources[which]
    status = stage_recipe(
        recipe_daemon, f"cifar{which}-{split}", f"cifar{which}", source, splits=[split]
    )
    usage = only_usage(status)
    assert usage.kwargs == {"train": split == "train"}
    module, _, name = usage.class_.rpartition(".")
    base = getattr(importlib.import_module(module), name)
    dataset = construct(usage, status.path, cifar_class_for_fakes(base, which, exp))
    targets = load_all(dataset)
    assert targets == exp.targets[split]
    assert dataset.classes == exp.classes
    assert np.array_equal(dataset.data, exp.data[split])


@pytest.mark.parametrize(
    ("split", "packed"), [("all", "folder"), ("train", "tar.gz"), ("val", "zip")]
)
def test_imagefolder_split_loads_in_torchvision(
    recipe_daemon: Daemon, tmp_path: Path, split: str, packed: str
) -> None:
    tree = tmp_path / "mydata"
    expected = fakes.make_imagefolder(tree, None if split == "all" else ["train", "val"])
    params: dict[str, Any] = {"splits": [split]}
    source = tree
    if packed != "folder":
        import shutil

        fmt = "gztar" if packed == "tar.gz" else "zip"
        # An archive with one top folder, as people make them: strip it.
        source = Path(shutil.make_archive(str(tmp_path / "mydata"), fmt, tmp_path, "mydata"))
        params["strip_components"] = 1
    status = stage_recipe(recipe_daemon, f"folder-{split}", "imagefolder", source, **params)
    dataset = construct(only_usage(status), status.path)
    exp = expected[split]
    targets = load_all(dataset)
    assert len(targets) == len(exp.files)
    assert dataset.classes == sorted(exp.classes)
    for (path, target), loaded in zip(dataset.samples, targets, strict=True):
        assert loaded == target and dataset.classes[target] == exp.files[os.path.basename(path)]


def test_status_lists_a_usage_per_chosen_split(
    recipe_daemon: Daemon, inat2021_source: tuple[Path, dict]
) -> None:
    source, _ = inat2021_source
    status = stage_recipe(recipe_daemon, "inat-default", "inat2021", source)
    versions = [u.kwargs["version"] for u in status.usage]
    assert versions == ["2021_train", "2021_valid"]  # the recipe's default splits
    with recipe_daemon.client() as client:
        again = client.get("/v1/datasets/inat-default").json()
    assert again["usage"][0]["class"] == "torchvision.datasets.INaturalist"
    assert "version='2021_valid'" in again["usage"][1]["code"]
