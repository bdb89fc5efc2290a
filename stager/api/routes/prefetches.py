"""/v1/prefetches: the planner's orders to stage (or cancel) a job's data before it starts.

The body is the signed order (stager.prestage.prefetch.authority): its ``action`` is inside what
the credential signs, so a credential for a stage can never cancel, nor one for a cancel
stage. The caller's socket grants nothing here: only the MUNGE credential does.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from stager.prestage.prefetch.authority import COPY_HEADER
from stager.wire.schemas import ErrorResponse

RESPONSES = {code: {"model": ErrorResponse} for code in (400, 401, 403, 409, 429)}
router = APIRouter(prefix="/v1/prefetches", tags=["prefetches"], responses=RESPONSES)


@router.post("")
async def order_prefetch(request: Request) -> dict[str, Any]:
    """Stage a job's declared dataset as its user, or cancel the job's prefetches, on
    the order of root or SlurmUser (``Authorization: Munge <credential>``)."""
    done = await request.app.state.prefetches.order(
        request.headers.get("authorization"),
        await request.body(),
        request.headers.get(COPY_HEADER),
    )
    return {"data": done, "count": len(done)}
