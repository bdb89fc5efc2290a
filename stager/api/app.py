"""App factory: wiring only. Routes live in ``stager.api.routes``."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi_offline import FastAPIOffline

from stager import __version__
from stager.api import body_limit, errors
from stager.api.auth import BearerTokenMiddleware
from stager.api.routes import cache as cache_routes
from stager.api.routes import datasets, health, prefetches, recipes, whoami
from stager.api.routes.fanout import fanout_router
from stager.core.metrics import Metrics
from stager.core.settings import Settings
from stager.engine.lifecycle import state_counts
from stager.engine.names import Names
from stager.engine.requests import Requests
from stager.engine.scheduler import Engine
from stager.prestage.placement.service import Placement
from stager.prestage.prefetch.service import Prefetches
from stager.state import cache


def cache_room(settings: Settings) -> tuple[int, int]:
    """(capacity, free) of the cache for the metrics: one statvfs at each scrape."""
    disk = shutil.disk_usage(settings.cache_dir)
    return settings.capacity_bytes or disk.total, disk.free


def create_app(settings: Settings, token: str | None = None) -> FastAPI:
    """Build the daemon's app. ``token``: require this bearer token on every request."""
    metrics = Metrics()
    engine = Engine(settings, metrics)
    names = Names(engine)
    requests = Requests(engine, names)
    prefetched = Prefetches(requests, settings, metrics)
    placement = Placement(engine, settings)
    prefetched.requested_as = placement.requested  # a prefetch names its data's feature too
    metrics.watch_states(
        lambda: state_counts(engine.entries()),
        lambda: cache.used_bytes(engine.entries()),
        lambda: cache_room(settings),
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            await engine.start()
        except BaseException:
            # What it started ends with it (user processes, the walker): the process
            # exits instead of waiting on a child that will not end by itself.
            await engine.stop()
            raise
        await requests.start()
        await prefetched.start()
        await placement.start()
        try:
            yield
        finally:
            await placement.stop()
            await prefetched.stop()
            await engine.stop()

    # /docs with Swagger UI's scripts served by the daemon itself: compute nodes often
    # have no internet, and FastAPI's own page loads them from a CDN. No /redoc.
    app = FastAPIOffline(
        redoc_url=None,
        static_url="/docs/assets",
        title="stager",
        version=__version__,
        summary="Per-node dataset staging and caching for deep-learning jobs",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.engine = engine
    app.state.requests = requests
    app.state.names = names
    app.state.metrics = metrics
    app.state.prefetches = prefetched
    app.state.placement = placement
    errors.install(app, engine.ops.public_names)
    body_limit.install(app, settings.max_body_bytes)
    app.include_router(datasets.stage_router(engine.ops))
    app.include_router(fanout_router(engine.ops))  # before /v1/datasets/{name} routes
    app.include_router(datasets.router)
    app.include_router(recipes.router)
    app.include_router(cache_routes.router)
    app.include_router(health.router)
    app.include_router(whoami.router)
    app.include_router(prefetches.router)
    if token:
        app.add_middleware(BearerTokenMiddleware, token=token)
    return app
