"""/v1/recipes: the named recipes this daemon knows."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from stager import recipes
from stager.api.deps import SettingsDep
from stager.blocking import run_io

router = APIRouter(prefix="/v1/recipes", tags=["recipes"])


@router.get("")
async def list_recipes(settings: SettingsDep) -> dict[str, Any]:
    # Recipe files are read from disk on every call (edits need no restart): off the loop.
    data = await run_io(recipes.available, settings)
    return {"data": data, "count": len(data)}
