"""Named recipes: a recipe + source + params expand into a list of steps.

The recipe files and their loader arrive with the recipes work (issue 4); until
then no recipe is known and a request naming one gets a clear 400.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from stager.errors import UnknownRecipe
from stager.schemas import DatasetCreate
from stager.settings import Settings


def available(settings: Settings) -> list[dict[str, Any]]:
    return []


@dataclass
class Expansion:
    """What a recipe turns into: the steps to run and how torchvision loads the result."""

    steps: list[Any]
    usage: list[dict[str, Any]] = field(default_factory=list)


def expand(request: DatasetCreate, settings: Settings) -> Expansion:
    names = ", ".join(r["name"] for r in available(settings)) or "none installed yet"
    raise UnknownRecipe(
        f"recipe {request.recipe!r} is not known (available: {names}); "
        "GET /v1/recipes lists them, or pass raw steps instead"
    )
