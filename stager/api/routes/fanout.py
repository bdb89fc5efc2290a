"""Multi-node fan-out (docs/multinode.md): what a job's per-node tasks ask of the daemon.

No ``from __future__ import annotations``: the probe's body is typed by the op table,
and FastAPI reads that class from the handler's annotation at run time.
"""

from fastapi import APIRouter

from stager.api.deps import CallerDep, EngineDep, RequestsDep
from stager.api.routes.datasets import RESPONSES
from stager.ops.table import OpTable
from stager.wire.schemas import (
    ExportCreate,
    ExportPublic,
    IncomingCreate,
    ProbeResult,
    TransferPublic,
)


def fanout_router(ops: OpTable) -> APIRouter:
    router = APIRouter(
        prefix="/v1",
        tags=["fan-out"],
        responses=RESPONSES,
    )
    DatasetCreate = ops.request_model()  # noqa: N806 - a class, named as the schema shows it

    @router.post("/datasets/probe", response_model=ProbeResult)
    async def probe(
        request: DatasetCreate, requests: RequestsDep, caller: CallerDep
    ) -> ProbeResult:
        """This node's cache key for a stage request, whether it holds that copy, and the
        request's source files when they could be broadcast as they are. Changes nothing."""
        return await requests.probe(request, caller)

    @router.post("/datasets/{name}/export", response_model=ExportPublic)
    async def export(
        name: str, request: ExportCreate, requests: RequestsDep, caller: CallerDep
    ) -> ExportPublic:
        """Pack part ``part`` of ready dataset ``name`` (a plain tar of whole files) in the
        cache's ``outgoing/<label>/``; part 0 plans the parts, the last one also writes
        the manifest (every path, size and sha256). Parts are asked for in order."""
        return await requests.export(name, request, caller)

    @router.delete("/exports/{label}", response_model=TransferPublic)
    async def drop_export(label: str, engine: EngineDep, caller: CallerDep) -> TransferPublic:
        """The caller's packed parts, once sent."""
        return await engine.fanout.drop_export(label, caller)

    @router.post("/incoming", response_model=TransferPublic)
    async def reserve(
        request: IncomingCreate, engine: EngineDep, caller: CallerDep
    ) -> TransferPublic:
        """Room for a delivery, in ``incoming/<label>/`` (node service: the caller's own
        ``incoming/<uid>/<label>/``): admission counts it, and the caller's quota, until it
        is adopted, released or expired (it may evict unleased entries, or answer 422)."""
        return await engine.fanout.reserve(request, caller)

    @router.delete("/incoming/{label}", response_model=TransferPublic)
    async def release(label: str, engine: EngineDep, caller: CallerDep) -> TransferPublic:
        """The caller's reservation and what was delivered into it."""
        return await engine.fanout.release(label, caller)

    return router
