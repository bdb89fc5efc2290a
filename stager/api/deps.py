"""Dependency aliases for route handlers."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from stager.engine import Engine
from stager.metrics import Metrics
from stager.settings import Settings


def get_engine(request: Request) -> Engine:
    return request.app.state.engine


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_metrics(request: Request) -> Metrics:
    return request.app.state.metrics


EngineDep = Annotated[Engine, Depends(get_engine)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]
