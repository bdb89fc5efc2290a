"""Dependency aliases for route handlers.

Each is an ``async def``: none blocks, and FastAPI runs a plain ``def`` dependency on
its thread pool, a hand-off to a thread and back (~0.2 ms) on every request."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Query, Request

from stager.core.identity import SCOPE_KEY, Caller
from stager.core.metrics import Metrics
from stager.core.settings import Settings
from stager.engine.names import Names
from stager.engine.requests import Requests
from stager.engine.scheduler import Engine
from stager.prestage.prefetch.authority import NotAuthorized


def _state(name: str) -> Any:
    """A dependency on ``app.state.<name>``: the engine, requests, names and the like."""

    async def get(request: Request) -> Any:
        return getattr(request.app.state, name)

    return Depends(get)


async def get_caller(request: Request) -> Caller:
    """Who asks: the kernel's word for the connection (SO_PEERCRED, read by the server)
    in the node service; the daemon's own user otherwise (its socket is 0700)."""
    caller = request.scope.get(SCOPE_KEY)
    if caller is not None:
        return caller
    if request.app.state.settings.multi_user:
        raise NotAuthorized(
            "the node service could not tell who is asking (no peer credentials on this "
            "connection); connect over its Unix socket"
        )
    return Caller.of_process()


EngineDep = Annotated[Engine, _state("engine")]
RequestsDep = Annotated[Requests, _state("requests")]
NamesDep = Annotated[Names, _state("names")]
CallerDep = Annotated[Caller, Depends(get_caller)]
# root acting on another user's dataset names; anyone else may only name themselves.
OwnerQuery = Annotated[
    int | None,
    Query(ge=0, le=2**32 - 2, description="uid whose dataset name this is (root only)"),
]
SettingsDep = Annotated[Settings, _state("settings")]
MetricsDep = Annotated[Metrics, _state("metrics")]
