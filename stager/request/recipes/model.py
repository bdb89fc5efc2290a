"""What a recipe file is: its schema, its tiny template language, and loading it.

A recipe file (TOML) names the release files a dataset ships as, per split, and the
steps that turn them into the layout a ``torchvision.datasets`` class loads; its
placeholders (``{source}``, ``{split}``, ``{<param>}``) are the whole template
language (docs/recipes.md): recipes stay data, and anything cleverer belongs in an op.
Every recipe has the parameters of :func:`builtin_params` without declaring them.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from stager.core.errors import RecipeFileError
from stager.ops.table import OpTable
from stager.wire.schemas import NAME_PATTERN

PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
PARAM_TYPES: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "int": (int,),
    "bool": (bool,),
    "list": (list,),
}


class ParamSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    description: str = ""
    type: Literal["str", "int", "bool", "list"] = "str"
    default: Any = None
    choices: list[Any] | None = None  # for a list, the allowed items

    @model_validator(mode="after")
    def _default_fits(self) -> ParamSpec:
        if self.default is not None:
            problem = value_problem(self, self.default)
            if problem:
                raise ValueError(f"default {self.default!r} {problem}")
        return self


class UsageSpec(BaseModel):
    """``class(root=<dataset>/<root>, **kwargs)``: how torchvision loads a split."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    class_: str = Field(alias="class", pattern=r"^[A-Za-z_][\w.]*$")
    kwargs: dict[str, Any] = Field(default_factory=dict)
    root: str = "."


class Section(BaseModel):
    """The common part, or one split: files expected in the source, steps, usage."""

    model_config = ConfigDict(extra="forbid")

    description: str = ""
    files: list[str] = Field(default_factory=list)  # relative to the source; "." is itself
    steps: list[dict[str, Any]] = Field(default_factory=list)
    usage: list[UsageSpec] = Field(default_factory=list)


class RecipeFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=NAME_PATTERN)
    description: str
    default_splits: list[str] | None = None  # None: all of them
    params: dict[str, ParamSpec] = Field(default_factory=dict)
    common: Section = Field(default_factory=Section)
    splits: dict[str, Section] = Field(min_length=1)

    @model_validator(mode="after")
    def _consistent(self) -> RecipeFile:
        if "splits" in self.params:
            raise ValueError("'splits' is built in (from the [splits] tables); do not declare it")
        unknown = set(self.default_splits or ()) - set(self.splits)
        if unknown:
            raise ValueError(f"default_splits names unknown splits {sorted(unknown)}")
        return self


def builtin_params(recipe: RecipeFile) -> dict[str, ParamSpec]:
    """The parameters every recipe has, then the file's own (which may override them)."""
    params = {
        "splits": ParamSpec(
            description="which splits to stage",
            type="list",
            choices=list(recipe.splits),
            default=recipe.default_splits or list(recipe.splits),
        ),
        "mode": ParamSpec(
            description="how archives travel: 'direct' extracts from the source, 'copy' "
            "copies them next to the data first, 'symlink' leaves a link to them",
            choices=["direct", "copy", "symlink"],
            default="direct",
        ),
        "verify_md5": ParamSpec(
            description="check each archive against the release's md5 first (one extra read)",
            type="bool",
            default=False,
        ),
    }
    params.update(recipe.params)
    return params


def value_problem(spec: ParamSpec, value: Any) -> str | None:
    """Why ``value`` does not fit ``spec`` (a phrase), or None when it does."""
    allowed = PARAM_TYPES[spec.type]
    # bool is an int in Python, but 'true' for a count is a mistake worth naming.
    if not isinstance(value, allowed) or (spec.type == "int" and isinstance(value, bool)):
        return f"must be of type {spec.type}"
    if spec.choices is not None:
        items = value if spec.type == "list" else [value]
        bad = [v for v in items if v not in spec.choices]
        if bad:
            choices = ", ".join(repr(c) for c in spec.choices)
            return f"has {', '.join(repr(b) for b in bad)}, not one of {choices}"
    return None


def render(value: Any, values: dict[str, Any]) -> Any:
    """Fill placeholders in every string of ``value`` (dicts and lists walked)."""
    if isinstance(value, dict):
        return {k: render(v, values) for k, v in value.items()}
    if isinstance(value, list):
        return [render(v, values) for v in value]
    if not isinstance(value, str):
        return value
    whole = PLACEHOLDER.fullmatch(value)
    if whole:
        return values[whole.group(1)]
    return PLACEHOLDER.sub(lambda m: str(values[m.group(1)]), value)


def placeholders(value: Any) -> set[str]:
    if isinstance(value, dict):
        return set().union(*(placeholders(v) for v in value.values()))
    if isinstance(value, list):
        return set().union(*(placeholders(v) for v in value))
    return set(PLACEHOLDER.findall(value)) if isinstance(value, str) else set()


def load(path: Path, ops: OpTable) -> RecipeFile:
    """Parse and validate one recipe file; errors name the file and the field."""
    try:
        with open(path, "rb") as stream:
            raw = tomllib.load(stream)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise RecipeFileError(f"recipe file {path} cannot be read: {exc}") from exc
    try:
        recipe = RecipeFile.model_validate(raw)
    except ValidationError as exc:
        raise RecipeFileError(f"recipe file {path}: {_describe(exc)}") from exc
    _check_templates(path, recipe, ops)
    return recipe


def _describe(exc: ValidationError, prefix: str = "") -> str:
    """The first few problems as "field: message"; one edit often causes two."""
    parts = []
    for error in exc.errors()[:3]:
        field = ".".join([*([prefix] if prefix else []), *(str(p) for p in error["loc"])])
        parts.append(f"{field or 'file'}: {error['msg'].removeprefix('Value error, ')}")
    return "; ".join(parts)


def _check_templates(path: Path, recipe: RecipeFile, ops: OpTable) -> None:
    """Render every section with the defaults and validate its steps, so a broken
    file fails when it is loaded rather than when someone stages with it."""
    params = builtin_params(recipe)
    sections = {"common": recipe.common, **{f"splits.{k}": v for k, v in recipe.splits.items()}}
    for where, section in sections.items():
        known = {"source", "split", *params} if where != "common" else {"source", *params}
        raw = {
            "steps": section.steps,
            "usage": [u.model_dump(by_alias=True) for u in section.usage],
        }
        unknown = placeholders(raw) - known
        if unknown:
            raise RecipeFileError(
                f"recipe file {path}: {where}: unknown placeholder(s) "
                f"{', '.join('{' + u + '}' for u in sorted(unknown))}; "
                f"known here: {', '.join(sorted(known))}"
            )
        values = {name: spec.default for name, spec in params.items()}
        values.update(source="/source", split=where.removeprefix("splits."))
        try:
            ops.validate_steps(render(section.steps, values))
        except ValidationError as exc:
            raise RecipeFileError(
                f"recipe file {path}: {_describe(exc, where + '.steps')}"
            ) from exc
