"""/v1/gc and /v1/leases: cache-wide housekeeping."""

from __future__ import annotations

from fastapi import APIRouter, Query

from stager.api.deps import CallerDep, NamesDep
from stager.wire.schemas import GcRequest, GcResult, LeasePublic

router = APIRouter(prefix="/v1", tags=["cache"])


@router.post("/gc", response_model=GcResult)
async def gc(names: NamesDep, caller: CallerDep, request: GcRequest | None = None) -> GcResult:
    """Evict superseded entries (or, with ``all``, every unleased ready one: root's in
    the node service, where a user's gc touches only their own private copies)."""
    return await names.gc(request or GcRequest(), caller)


@router.delete("/leases", response_model=list[LeasePublic])
async def release_holder(
    names: NamesDep, caller: CallerDep, holder: str = Query(..., description="e.g. slurm-job-42")
) -> list[LeasePublic]:
    """Release every lease one holder has on any of the caller's datasets (root: any
    user's): what a job's epilog calls."""
    return await names.release_holder(holder, caller)
