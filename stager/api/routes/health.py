"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from stager import __version__
from stager.api.deps import EngineDep, MetricsDep

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok", "version": __version__}


@router.get("/readyz")
async def readyz(engine: EngineDep) -> JSONResponse:
    if engine.started:
        return JSONResponse({"status": "ready"})
    return JSONResponse({"status": "starting"}, status_code=503)


@router.get("/metrics")
async def metrics(registry: MetricsDep) -> Response:
    return Response(generate_latest(registry.registry), media_type=CONTENT_TYPE_LATEST)
