"""/v1/datasets: stage, list, status, wait, events, cancel/evict."""

from __future__ import annotations

from fastapi import APIRouter, Query, Response, status
from sse_starlette import EventSourceResponse

from stager.api.deps import EngineDep
from stager.schemas import DatasetCreate, DatasetPublic, DatasetsPublic, ErrorResponse

router = APIRouter(
    prefix="/v1/datasets",
    tags=["datasets"],
    responses={
        400: {"model": ErrorResponse},
        404: {"model": ErrorResponse},
        409: {"model": ErrorResponse},
        422: {"model": ErrorResponse},
    },
)


@router.post("", response_model=DatasetPublic, status_code=status.HTTP_202_ACCEPTED)
async def stage(request: DatasetCreate, engine: EngineDep, response: Response) -> DatasetPublic:
    """Stage a dataset, or join the staging of an identical request.

    202 while queued or staging, 200 when already ready, 409 when the name is
    taken by a different request.
    """
    view, ready = await engine.submit(request)
    if ready:
        response.status_code = status.HTTP_200_OK
    return view


@router.get("", response_model=DatasetsPublic)
async def list_datasets(engine: EngineDep) -> DatasetsPublic:
    data = engine.list()
    return DatasetsPublic(data=data, count=len(data))


@router.get("/{name}", response_model=DatasetPublic)
async def get_dataset(name: str, engine: EngineDep) -> DatasetPublic:
    return engine.get(name)


@router.get("/{name}/wait", response_model=DatasetPublic)
async def wait_dataset(
    name: str,
    engine: EngineDep,
    timeout: float = Query(30.0, ge=0, le=3600, description="seconds to wait at most"),
) -> DatasetPublic:
    """Long-poll until the dataset is ready, failed or cancelled, or ``timeout`` passes."""
    return await engine.wait(name, timeout)


@router.get("/{name}/events")
async def dataset_events(name: str, engine: EngineDep) -> EventSourceResponse:
    """Server-sent events: a ``status`` event per change until a terminal state."""
    engine.get(name)  # 404 before the stream starts, not inside it

    async def events():
        async for view in engine.watch(name):
            yield {"event": "status", "data": view.model_dump_json()}

    return EventSourceResponse(events(), ping=15)


@router.delete("/{name}", response_model=DatasetPublic)
async def delete_dataset(name: str, engine: EngineDep) -> DatasetPublic:
    """Cancel a staging, evict a ready dataset, or forget a finished one."""
    return await engine.delete(name)
