"""Recipe requests through a real daemon: listing, params, missing files, archive
modes, md5 checks, user recipe files; and the ``stager recipes`` command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stager.wire.schemas import DatasetPublic
from tests.daemon import Daemon
from tests.stager.recipes import fakes
from tests.stager.recipes.test_recipes_load import construct, load_all, stage_recipe

pytestmark = pytest.mark.forked_daemons  # its daemons: tests/daemon_zygote.py

BUILTIN = {
    "cifar10",
    "cifar100",
    "imagefolder",
    "imagenet",
    "inat2017",
    "inat2018",
    "inat2019",
    "inat2021",
}


@pytest.fixture(scope="module")
def valid_only(tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = tmp_path_factory.mktemp("inat-val")
    fakes.make_inat2021(source, ["2021_valid"])
    return source


def test_get_recipes_lists_params_files_and_usage(recipe_daemon: Daemon) -> None:
    with recipe_daemon.client() as client:
        body = client.get("/v1/recipes").json()
    recipes = {r["name"]: r for r in body["data"]}
    assert set(recipes) == BUILTIN and body["count"] == len(BUILTIN)
    inat = recipes["inat2021"]
    params = {p["name"]: p for p in inat["params"]}
    assert params["splits"]["choices"] == ["2021_train", "2021_train_mini", "2021_valid"]
    assert params["splits"]["default"] == ["2021_train", "2021_valid"]
    assert params["mode"]["default"] == "direct" and params["verify_md5"]["default"] is False
    assert inat["splits"]["2021_train"]["files"] == ["train.tar.gz"]
    usage = inat["splits"]["2021_valid"]["usage"][0]
    assert usage == {
        "class": "torchvision.datasets.INaturalist",
        "kwargs": {"version": "2021_valid"},
        "root": ".",
    }
    imagenet = recipes["imagenet"]["splits"]["val"]["files"]
    assert imagenet == ["ILSVRC2012_devkit_t12.tar.gz", "ILSVRC2012_img_val.tar"]


@pytest.mark.parametrize(
    ("recipe", "params", "error_type", "words"),
    [
        ("nope", {}, "unknown_recipe", ["'nope'", "inat2021"]),
        ("inat2021", {"splits": ["2021_test"]}, "bad_request", ["'2021_test'", "2021_train_mini"]),
        ("inat2021", {"colour": "red"}, "bad_request", ["'colour'", "splits, mode, verify_md5"]),
        ("inat2021", {"mode": "teleport"}, "bad_request", ["'teleport'", "'symlink'"]),
        ("inat2021", {"verify_md5": "yes"}, "bad_request", ["verify_md5", "bool"]),
        ("inat2021", {"splits": []}, "bad_request", ["empty", "2021_valid"]),
        # The fixture holds val.tar.gz only; the default splits also want train.tar.gz.
        ("inat2021", {}, "source_not_found", ["train.tar.gz", "'inat2021'", "'2021_train'"]),
        ("imagefolder", {"verify_md5": True}, "bad_request", ["no md5 is known"]),
    ],
)
def test_bad_recipe_requests_are_400s_naming_the_input(
    recipe_daemon: Daemon,
    valid_only: Path,
    recipe: str,
    params: dict,
    error_type: str,
    words: list[str],
) -> None:
    body = {"name": "bad", "recipe": recipe, "source": str(valid_only), "params": params}
    with recipe_daemon.client() as client:
        response = client.post("/v1/datasets", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == error_type
    for word in words:
        assert word in error["message"], error["message"]


def test_missing_source_folder_and_relative_source_are_refused(recipe_daemon: Daemon) -> None:
    with recipe_daemon.client() as client:
        missing = client.post(
            "/v1/datasets", json={"name": "x", "recipe": "cifar10", "source": "/no/such/place"}
        )
        relative = client.post(
            "/v1/datasets", json={"name": "x", "recipe": "cifar10", "source": "data/cifar"}
        )
        absent = client.post("/v1/datasets", json={"name": "x", "recipe": "cifar10"})
    assert missing.status_code == 400 and "/no/such/place" in missing.json()["error"]["message"]
    # A relative source is malformed (the request model refuses it), not merely absent.
    assert relative.status_code == 422 and "absolute" in relative.json()["error"]["message"]
    assert absent.status_code == 400
    assert "cifar-10-python.tar.gz" in absent.json()["error"]["message"]


@pytest.mark.parametrize("mode", ["copy", "symlink"])
def test_archive_modes_keep_the_archive_under_torchvisions_name(
    recipe_daemon: Daemon, valid_only: Path, mode: str
) -> None:
    status = stage_recipe(
        recipe_daemon, f"inat-{mode}", "inat2021", valid_only, splits=["2021_valid"], mode=mode
    )
    kept = Path(status.path) / "2021_valid.tgz"
    assert sorted(os.listdir(status.path)) == ["2021_valid", "2021_valid.tgz"]
    if mode == "symlink":
        assert kept.is_symlink() and os.readlink(kept) == str(valid_only / "val.tar.gz")
    else:
        assert not kept.is_symlink()
        assert kept.read_bytes() == (valid_only / "val.tar.gz").read_bytes()
    dataset = construct(status.usage[0], status.path)
    assert len(load_all(dataset)) == 9


def test_verify_md5_checks_the_release_checksum_and_names_the_archive(
    recipe_daemon: Daemon, valid_only: Path
) -> None:
    body = {
        "name": "inat-md5",
        "recipe": "inat2021",
        "source": str(valid_only),
        "params": {"splits": ["2021_valid"], "verify_md5": True},
    }
    with recipe_daemon.client() as client:
        assert client.post("/v1/datasets", json=body).status_code == 202
        waited = client.get("/v1/datasets/inat-md5/wait", params={"timeout": 60})
    status = DatasetPublic.model_validate_json(waited.text)
    assert status.state == "failed" and status.error.type == "verify_failed"
    assert str(valid_only / "val.tar.gz") in status.error.message
    assert "f6f6e0e242e3d4c9569ba56400938afc" in status.error.message  # torchvision's md5


def write_user_recipe(folder: Path, text: str, name: str = "mine.toml") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(text)
    return folder


USER_RECIPE = """
name = "flowers"
description = "our lab's flower photos, one zip per split"

[splits.train]
files = ["flowers-train.zip"]
steps = [{ op = "unpack", src = "{source}/flowers-train.zip", dst = "train", mode = "{mode}" }]
usage = [{ class = "torchvision.datasets.ImageFolder", root = "train" }]
"""


def test_user_recipe_folder_adds_a_recipe_that_stages(daemon_factory, tmp_path: Path) -> None:
    import shutil

    folder = write_user_recipe(tmp_path / "recipes", USER_RECIPE)
    expected = fakes.make_imagefolder(tmp_path / "photos", None)["all"]
    source = tmp_path / "src"
    source.mkdir()
    shutil.make_archive(str(source / "flowers-train"), "zip", tmp_path / "photos")
    daemon = daemon_factory(env={"STAGER_RECIPE_DIRS": json.dumps([str(folder)])})
    with daemon.client() as client:
        names = {r["name"] for r in client.get("/v1/recipes").json()["data"]}
    assert names == BUILTIN | {"flowers"}
    status = stage_recipe(daemon, "flowers", "flowers", source)
    dataset = construct(status.usage[0], status.path)
    assert len(load_all(dataset)) == len(expected.files)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        (USER_RECIPE.replace('op = "unpack"', 'op = "unzip"'), ["splits.train.steps", "unzip"]),
        (USER_RECIPE.replace("{mode}", "{speed}"), ["splits.train", "{speed}"]),
        (USER_RECIPE.replace("description =", "summary ="), ["summary"]),
        (USER_RECIPE.replace('name = "flowers"', 'name = "Flowers!"'), ["name"]),
        ("name = [", ["cannot be read"]),
    ],
)
def test_a_broken_user_recipe_file_is_named_with_its_field(
    tmp_path: Path, text: str, words: list[str]
) -> None:
    folder = write_user_recipe(tmp_path / "recipes", text)
    done = subprocess.run(
        [sys.executable, "-m", "stager", "recipes", "--recipe-dir", str(folder)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1
    assert str(folder / "mine.toml") in done.stderr
    for word in words:
        assert word in done.stderr, done.stderr


def test_stager_recipes_command_lists_every_recipe(tmp_path: Path) -> None:
    folder = write_user_recipe(tmp_path / "recipes", USER_RECIPE)
    text = subprocess.run(
        [sys.executable, "-m", "stager", "recipes", "--recipe-dir", str(folder)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for name in BUILTIN | {"flowers"}:
        assert f"\n{name}: " in f"\n{text}"
    assert "split 2021_train: needs train.tar.gz -> torchvision.datasets.INaturalist(" in text
    listing = json.loads(
        subprocess.run(
            [sys.executable, "-m", "stager", "recipes", "--json"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    assert {r["name"] for r in listing["data"]} == BUILTIN
