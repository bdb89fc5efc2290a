"""/v1/gc: drop dead leases and evict what nobody needs."""

from __future__ import annotations

from fastapi import APIRouter

from stager.api.deps import EngineDep
from stager.schemas import GcRequest, GcResult

router = APIRouter(prefix="/v1", tags=["cache"])


@router.post("/gc", response_model=GcResult)
async def gc(engine: EngineDep, request: GcRequest | None = None) -> GcResult:
    """Evict superseded entries (or, with ``all``, every unleased ready one)."""
    return await engine.gc(request or GcRequest())
