"""Named recipes: a recipe + source + params expand into steps and torchvision usage.

Recipes are data: one TOML file each, shipped in this folder, plus any found in
``settings.recipe_dirs`` (one with a shipped recipe's name replaces it). ``model``
holds the file schema and the template rules. Files are read on every call, so an
edited recipe takes effect without a restart.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from stager.core.errors import BadRequest, SourceNotFound, UnknownRecipe
from stager.core.settings import Settings
from stager.ops import table
from stager.request.recipes.model import (
    RecipeFile,
    RecipeFileError,
    Section,
    builtin_params,
    load,
    render,
    value_problem,
)
from stager.wire.schemas import DatasetCreate
from stager.wire.suggest import did_you_mean

BUILTIN_DIR = Path(__file__).parent

__all__ = ["Expansion", "RecipeFileError", "available", "expand", "recipe_files"]


@dataclass
class Expansion:
    """What a recipe turns into: the steps to run and how torchvision loads the result."""

    steps: list[Any]
    usage: list[dict[str, Any]] = field(default_factory=list)


def recipe_files(settings: Settings) -> dict[str, tuple[Path, RecipeFile]]:
    """Every recipe by name: shipped ones first, then the user's folders in order."""
    found: dict[str, tuple[Path, RecipeFile]] = {}
    ops = table.for_settings(settings)
    for folder in [BUILTIN_DIR, *settings.recipe_dirs]:
        if folder != BUILTIN_DIR and not folder.is_dir():
            raise RecipeFileError(
                f"recipe folder {folder} (STAGER_RECIPE_DIRS or --recipe-dir) is not a directory; "
                "fix the setting or create the folder"
            )
        for path in sorted(folder.glob("*.toml")):
            recipe = load(path, ops)
            found[recipe.name] = (path, recipe)
    return found


def available(settings: Settings) -> list[dict[str, Any]]:
    """The recipes ``GET /v1/recipes`` and ``stager recipes`` show, sorted by name."""
    return [describe(path, r) for _, (path, r) in sorted(recipe_files(settings).items())]


def describe(path: Path, recipe: RecipeFile) -> dict[str, Any]:
    params = [
        {"name": name, **spec.model_dump(exclude_none=True)}
        for name, spec in builtin_params(recipe).items()
    ]
    splits = {
        name: {
            "description": section.description,
            "files": [*recipe.common.files, *section.files],
            "usage": [u.model_dump(by_alias=True) for u in [*recipe.common.usage, *section.usage]],
        }
        for name, section in recipe.splits.items()
    }
    return {
        "name": recipe.name,
        "description": recipe.description,
        "file": str(path),
        "params": params,
        "splits": splits,
    }


def expand(request: DatasetCreate, settings: Settings) -> Expansion:
    """Validate params, then render the chosen splits' steps and usage. The release files
    are looked for by the caller's own process (:func:`check_sources`), never by root."""
    recipe, values, source, chosen = _choose(
        request.recipe or "", request.params, request.source, settings
    )
    steps: list[Any] = []
    usage: list[dict[str, Any]] = []
    for split, section in [("", recipe.common), *chosen]:
        scope = {**values, "source": source, "split": split}
        steps.extend(render(section.steps, scope))
        usage.extend(render([u.model_dump(by_alias=True) for u in section.usage], scope))
    # The file was validated with defaults; a request's values may still not fit a step.
    try:
        validated = table.for_settings(settings).validate_steps(steps)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise BadRequest(
            f"recipe {recipe.name!r} with these params makes an invalid step "
            f"(steps.{where}: {first['msg']}); check the params' values"
        ) from exc
    return Expansion(steps=validated, usage=usage)


def check_sources(
    name: str, params: dict[str, Any], source: str | None, settings: Settings
) -> None:
    """Fail when a release file the chosen splits of recipe ``name`` need is missing."""
    recipe, _values, folder, chosen = _choose(name, params, source, settings)
    _check_files(recipe, folder, chosen)


def _choose(
    name: str, params: dict[str, Any], given_source: str | None, settings: Settings
) -> tuple[RecipeFile, dict[str, Any], str, list[tuple[str, Section]]]:
    """The recipe, its params' values, its source and its chosen splits."""
    recipes = recipe_files(settings)
    if name not in recipes:
        names = ", ".join(sorted(recipes)) or "none installed"
        raise UnknownRecipe(
            f"recipe {name!r} is not known; {did_you_mean(name, recipes)}"
            f"the recipes: {names} (GET /v1/recipes describes them), or pass raw steps instead"
        )
    _, recipe = recipes[name]
    values = _params(recipe, params)
    source = _source(recipe, given_source)
    chosen = [(name, recipe.splits[name]) for name in recipe.splits if name in values["splits"]]
    return recipe, values, source, chosen


def _params(recipe: RecipeFile, given: dict[str, Any]) -> dict[str, Any]:
    specs = builtin_params(recipe)
    unknown = sorted(set(given) - set(specs))
    if unknown:
        raise BadRequest(
            f"recipe {recipe.name!r} has no parameter {', '.join(map(repr, unknown))}; "
            f"{did_you_mean(unknown[0], specs)}"
            f"its parameters are {', '.join(specs)} (GET /v1/recipes describes them)"
        )
    values = {name: spec.default for name, spec in specs.items()}
    for name, value in given.items():
        if name == "splits" and isinstance(value, str):
            value = [value]  # one split is a natural thing to write as a string
        problem = value_problem(specs[name], value)
        if problem:
            raise BadRequest(f"parameter {name!r} of recipe {recipe.name!r} {problem}")
        values[name] = value
    if not values["splits"]:
        raise BadRequest(
            f"parameter 'splits' of recipe {recipe.name!r} is empty; "
            f"name at least one of {', '.join(recipe.splits)}"
        )
    return values


def _source(recipe: RecipeFile, source: str | None) -> str:
    sections = [recipe.common, *recipe.splits.values()]
    expected = ", ".join(sorted({f for s in sections for f in s.files if f != "."}))
    if not source:
        raise BadRequest(
            f"recipe {recipe.name!r} needs a 'source': the folder holding its release "
            f"files ({expected or 'see GET /v1/recipes'})"
        )
    if not source.startswith("/"):
        raise BadRequest(f"source {source!r} must be an absolute path")
    return source.rstrip("/") or "/"


def _check_files(recipe: RecipeFile, source: str, chosen: list[tuple[str, Section]]) -> None:
    """Fail before queueing when a release file the chosen splits need is missing."""
    if not os.path.exists(source):
        raise SourceNotFound(
            f"source {source} for recipe {recipe.name!r} does not exist; check --source"
        )
    for split, section in [("all splits", recipe.common), *chosen]:
        for name in section.files:
            path = source if name == "." else os.path.join(source, name)
            if not os.path.exists(path):
                which = split if split == "all splits" else f"split {split!r}"
                raise SourceNotFound(
                    f"recipe {recipe.name!r} expects {path} for {which}, but it does not "
                    "exist; check --source, or narrow params.splits to the splits you have"
                )
    if "." in recipe.common.files and os.path.isdir(source):
        _check_usage_roots(recipe, source, chosen)


def _check_usage_roots(recipe: RecipeFile, source: str, chosen: list[tuple[str, Section]]) -> None:
    """A folder staged as it is: each chosen split's torchvision root must be in it, or
    the dataset would go ready naming a folder it does not have."""
    for split, section in chosen:
        for usage in section.usage:
            root = usage.root.strip("/")
            if "{" in root or root in ("", ".") or os.path.isdir(os.path.join(source, root)):
                continue
            present = sorted(e.name for e in os.scandir(source) if e.is_dir())[:8]
            raise SourceNotFound(
                f"split {split!r} of recipe {recipe.name!r} loads {root}/ of the source, but "
                f"{source} has no folder {root}/ (its folders: {', '.join(present) or 'none'}); "
                "check --source, or choose the splits it has (--param splits=...)"
            )
