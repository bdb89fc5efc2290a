"""/v1/datasets: stage, list, status, wait, events, cancel/evict.

No ``from __future__ import annotations`` here: the body of ``POST`` is typed by
the op table (its steps are the ops' own models, so ``/docs`` shows each op), and
FastAPI reads that class from the handler's annotation at run time.
"""

from fastapi import APIRouter, Query, Request, Response, status
from sse_starlette import EventSourceResponse

from stager.api.deps import CallerDep, NamesDep, OwnerQuery, RequestsDep
from stager.ops.table import OpTable
from stager.wire.schemas import (
    DatasetPublic,
    DatasetsPublic,
    ErrorResponse,
    LeaseCreate,
    LeasePublic,
)

RESPONSES = {
    400: {"model": ErrorResponse},
    404: {"model": ErrorResponse},
    409: {"model": ErrorResponse},
    422: {"model": ErrorResponse},
}
router = APIRouter(prefix="/v1/datasets", tags=["datasets"], responses=RESPONSES)


def stage_router(ops: OpTable) -> APIRouter:
    """``POST /v1/datasets``, its steps typed by ``ops``: built per app, as the table is."""
    stage_routes = APIRouter(prefix="/v1/datasets", tags=["datasets"], responses=RESPONSES)
    DatasetCreate = ops.request_model()  # noqa: N806 - a class, named as the schema shows it

    @stage_routes.post("", response_model=DatasetPublic, status_code=status.HTTP_202_ACCEPTED)
    async def stage(
        request: DatasetCreate,
        requests: RequestsDep,
        caller: CallerDep,
        response: Response,
        http: Request,
    ) -> DatasetPublic:
        """Stage a dataset, or join the staging of an identical request.

        202 while queued or staging, 200 when already ready, 409 when the name is
        taken by a different request.
        """
        view, ready = await requests.submit(request, caller)
        await http.app.state.prefetches.requested(caller, view)  # a job using its prefetch
        http.app.state.placement.requested(request, caller, view)  # its node feature
        if ready:
            response.status_code = status.HTTP_200_OK
        return view

    return stage_routes


@router.get("", response_model=DatasetsPublic)
async def list_datasets(names: NamesDep, caller: CallerDep) -> DatasetsPublic:
    """The caller's datasets (root: every user's)."""
    data = names.list(caller)
    return DatasetsPublic(data=data, count=len(data))


@router.get("/{name}", response_model=DatasetPublic)
async def get_dataset(
    name: str, names: NamesDep, caller: CallerDep, owner: OwnerQuery = None
) -> DatasetPublic:
    return names.get(name, caller, owner)


@router.get("/{name}/wait", response_model=DatasetPublic)
async def wait_dataset(
    name: str,
    names: NamesDep,
    caller: CallerDep,
    timeout: float = Query(30.0, ge=0, le=3600, description="seconds to wait at most"),
    owner: OwnerQuery = None,
) -> DatasetPublic:
    """Long-poll until the dataset is ready, failed or cancelled, or ``timeout`` passes."""
    return await names.wait(name, timeout, caller, owner)


@router.get("/{name}/events")
async def dataset_events(
    name: str, names: NamesDep, caller: CallerDep, owner: OwnerQuery = None
) -> EventSourceResponse:
    """Server-sent events: a ``status`` event per change until a terminal state."""
    names.get(name, caller, owner)  # 404 before the stream starts, not inside it

    async def events():
        async for view in names.watch(name, caller, owner):
            yield {"event": "status", "data": view.model_dump_json()}

    return EventSourceResponse(events(), ping=15)


@router.delete("/{name}", response_model=DatasetPublic)
async def delete_dataset(
    name: str, names: NamesDep, caller: CallerDep, owner: OwnerQuery = None
) -> DatasetPublic:
    """Cancel a staging, evict a ready dataset, or forget a finished one."""
    return await names.delete(name, caller, owner)


@router.post("/{name}/leases", response_model=LeasePublic, status_code=status.HTTP_201_CREATED)
async def add_lease(
    name: str, request: LeaseCreate, names: NamesDep, caller: CallerDep, owner: OwnerQuery = None
) -> LeasePublic:
    """Pin the dataset while a job uses it; one lease per holder (a repeat renews it)."""
    return await names.lease(name, request, caller, owner)


@router.get("/{name}/leases", response_model=list[LeasePublic])
async def list_leases(
    name: str, names: NamesDep, caller: CallerDep, owner: OwnerQuery = None
) -> list[LeasePublic]:
    return names.get(name, caller, owner).leases


@router.delete("/{name}/leases", response_model=list[LeasePublic])
async def release_leases(
    name: str,
    names: NamesDep,
    caller: CallerDep,
    holder: str | None = Query(None, description="only this holder's leases"),
    owner: OwnerQuery = None,
) -> list[LeasePublic]:
    """Release every lease on the dataset, or those of one holder (a job's epilog)."""
    return await names.release(name, caller, holder=holder, owner=owner)


@router.delete("/{name}/leases/{lease_id}", response_model=list[LeasePublic])
async def release_lease(
    name: str, lease_id: str, names: NamesDep, caller: CallerDep, owner: OwnerQuery = None
) -> list[LeasePublic]:
    return await names.release(name, caller, lease_id=lease_id, owner=owner)
