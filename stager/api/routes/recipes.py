"""/v1/recipes: the named recipes this daemon knows, and the ops raw steps may use."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from stager.api.deps import EngineDep, SettingsDep
from stager.request import recipes
from stager.staging.blocking import run_io

router = APIRouter(prefix="/v1/recipes", tags=["recipes"])


@router.get("")
async def list_recipes(settings: SettingsDep, engine: EngineDep) -> dict[str, Any]:
    """Recipes with their params and splits; ``ops``: every op with its fields and the
    ``verify`` levels it honours."""
    # Recipe files are read from disk on every call (edits need no restart): off the loop.
    data = await run_io(recipes.available, settings)
    return {"data": data, "count": len(data), "ops": engine.ops.describe()}
